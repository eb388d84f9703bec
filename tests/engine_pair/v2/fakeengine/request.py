"""Request (v2): `eos_token_id` removed."""


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int]):
        self.request_id = request_id

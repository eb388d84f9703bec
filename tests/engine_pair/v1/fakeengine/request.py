"""Request (v1)."""


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], eos_token_id: int | None = None):
        self.request_id = request_id

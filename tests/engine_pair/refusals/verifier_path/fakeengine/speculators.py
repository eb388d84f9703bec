"""Reading a speculators-format export config (verifier_path): the reader now refuses a verifier that is not a
hub repository, as vLLM 0.33 does: a validator called in a try (its except raises) and a check on a `Path()`
of our value."""

from pathlib import Path

SUPPORTED = {"eagle3": "Eagle3Speculator"}


def _validate_repo_id(name: str) -> None:
    if name.startswith("/"):
        raise KeyError(name)


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    if kind not in SUPPORTED:
        raise ValueError(f"unsupported {kind}")
    spec = config_dict["speculators_config"]
    tokens = spec["proposal_methods"][0]["speculative_tokens"]
    verifier = spec["verifier"]["name_or_path"]
    try:
        _validate_repo_id(verifier)
    except KeyError as exc:
        raise ValueError("the verifier must name a hub repository") from exc
    local = Path(verifier)
    if local.exists():
        raise ValueError("the verifier must name a hub repository")
    return {"tokens": tokens, "hidden": config_dict.get("target_hidden_size")}

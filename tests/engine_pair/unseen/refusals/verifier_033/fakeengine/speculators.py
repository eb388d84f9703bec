"""Reading a speculators-format export config (verifier_033): vLLM 0.33's check that the verifier names a hub
repository (vllm/transformers_utils/config.py:861-873), refusing a local path (issue 37 item 3)."""

from pathlib import Path

from huggingface_hub.utils import HFValidationError, validate_repo_id

SUPPORTED = {"eagle3": "Eagle3Speculator"}


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    if kind not in SUPPORTED:
        raise ValueError(f"unsupported {kind}")
    spec = config_dict["speculators_config"]
    tokens = spec["proposal_methods"][0]["speculative_tokens"]
    verifier_model = spec["verifier"]["name_or_path"]
    try:
        validate_repo_id(verifier_model)
    except HFValidationError as exc:
        raise ValueError("Speculators verifier must name a remote model repository.") from exc
    verifier_path = Path(verifier_model)
    if verifier_path.exists() or verifier_path.is_symlink():
        raise ValueError("Speculators verifier must name a remote model repository.")
    return {"tokens": tokens, "hidden": config_dict.get("target_hidden_size")}

"""`--push_to_hub REPO`: an export uploaded to a Hugging Face Hub model repository (created if
missing), with the token of `huggingface-cli login` or HF_TOKEN. Checked before anything is
exported: a repository id that is not one, or a machine offline (HF_HUB_OFFLINE), is refused in
one line rather than after the export."""

from __future__ import annotations

import os
from pathlib import Path

from swarm.config.messages import library_message


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def check_repo(repo: str) -> None:
    """ValueError in one line unless `repo` names a Hub repository (owner/name) we may reach."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise ValueError(f"--push_to_hub {repo!r}: not a repository id ({library_message(e)})") from None
    if "/" not in repo:
        raise ValueError(f"--push_to_hub {repo!r}: name the repository as OWNER/NAME")
    if offline():
        raise ValueError(f"--push_to_hub {repo}: the Hugging Face Hub is off here (HF_HUB_OFFLINE is set)")


def push(directory: Path, repo: str) -> str:
    """Uploads `directory` to model repository `repo`; where it went."""
    from huggingface_hub import HfApi

    check_repo(repo)
    api = HfApi()
    try:
        api.create_repo(repo, repo_type="model", exist_ok=True)
        commit = api.upload_folder(folder_path=str(directory), repo_id=repo, repo_type="model")
    except Exception as e:  # no token, no network, no rights: one line
        raise ValueError(f"--push_to_hub {repo}: {type(e).__name__}: {library_message(e)}") from None
    return f"pushed to https://huggingface.co/{repo} ({getattr(commit, 'oid', '') or 'uploaded'})"

"""Models, tokenizers and datasets named by their Hugging Face Hub id, as `transformers`, TRL and
`datasets` take them: `org/name`, `org/name@revision` (a branch, tag or commit hash), and for a
dataset input also `org/name[@revision]:split` or `org/name[@revision]:config:split`.

What is a path and what is an id is decided here, without the network (`hub_ref`): an existing path
is a path; so is anything that starts with `.`, `/` or `~`, ends with a data file's extension, is not
`owner/name` in the Hub's characters, or whose first part is an existing local folder (`data/tokenizr`
is a mistyped `data/tokenizer`, never a Hub id).

`resolve` gives the id's local folder and commit hash: from the local Hugging Face cache, downloaded
first when not there (huggingface_hub's progress bars). Offline (`--offline`, `HF_HUB_OFFLINE=1`)
nothing touches the network. The Hub is asked once, with a bounded timeout, before any download:
"not found", "gated" and "no such revision" are each one line at once (huggingface_hub retries none
of them); a Hub that cannot be reached falls back to the cache. The standard token (`HF_TOKEN`, or
`hf auth login`) is used for gated and private repos.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import UserError, one_line
from pipeline.files.contained import contained, escape
from pipeline.splits import HF_FILES

_PART = r"[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"^{_PART}/{_PART}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_TRUE = ("1", "on", "yes", "true")
# suffixes that make a name a file path, never a Hub id (Hub repo names may hold dots: Qwen2.5-7B)
_FILE_SUFFIXES = (
    ".jsonl",
    ".ndjson",
    ".json",
    ".parquet",
    ".pq",
    ".arrow",
    ".feather",
    ".ipc",
    ".csv",
    ".tsv",
    ".gz",
    ".zst",
    ".txt",
    ".model",
    ".safetensors",
    ".bin",
)
# a tokenizer's files (what `pipeline.tokenize.tokenizer` reads; config.json is weighed by AutoTokenizer)
TOKENIZER_PATTERNS = [
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab*",
    "merges.txt",
    "chat_template*",
    "*.tiktoken",
    "config.json",
]
# a model's files: configs, safetensors weights, tokenizer files; not the original/ checkpoints of
# some repos, nor .bin / .h5 / .msgpack weights the project never loads
MODEL_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"]
MODEL_IGNORE = ["original/*", "*/original/*"]


@dataclass(frozen=True)
class HubRef:
    """A Hub id as given: repo, revision asked for (None: the default branch), and for a dataset its
    config and split (None: the card's default config; the split defaults to "train")."""

    repo_id: str
    revision: str | None = None
    config: str | None = None
    split: str | None = None

    def pinned(self, commit: str) -> str:
        """The same reference at one commit: `org/name@commit[:config][:split]`."""
        tail = "".join(f":{p}" for p in (self.config, self.split) if p is not None)
        return f"{self.repo_id}@{commit}{tail}"


def hub_ref(spec: str, *, dataset: bool = False) -> HubRef | None:
    """The Hub reference `spec` names, or None when it is a path (the rule in the module docstring).
    Needs no network and imports nothing."""
    spec = str(spec)
    if not spec or os.path.lexists(os.path.expanduser(spec)) or spec.startswith((".", "/", "~")) or "\\" in spec:
        return None
    parts = spec.split(":") if dataset else [spec]
    if len(parts) > 3 or not all(parts):
        return None
    repo, _, revision = parts[0].partition("@")
    if not _REPO_ID.match(repo) or "--" in repo or ".." in repo or repo.lower().endswith(_FILE_SUFFIXES):
        return None
    if "@" in parts[0] and not revision:
        return None
    if revision and escape(revision) is not None:  # the cache keeps refs/REVISION and snapshots/REVISION
        raise UserError(
            f"{spec}: revision {revision!r} is no branch, tag or commit ({escape(revision)}): give one such as @main or a commit hash"
        )
    if os.path.isdir(repo.split("/")[0]):  # data/tokenizr: a typo'd path under a local folder
        return None
    config = parts[1] if len(parts) == 3 else None
    split = parts[-1] if len(parts) > 1 else None
    return HubRef(repo, revision or None, config, split)


def is_offline() -> bool:
    """Whether the Hub must not be contacted: `--offline` (which sets HF_HUB_OFFLINE=1), or
    HF_HUB_OFFLINE / HF_DATASETS_OFFLINE / TRANSFORMERS_OFFLINE set to 1."""
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(n, "").strip().lower() in _TRUE for n in names)


def go_offline() -> None:
    """What `--offline` does: HF_HUB_OFFLINE=1 for this process and the processes it starts."""
    os.environ["HF_HUB_OFFLINE"] = "1"


OFFLINE_HELP = "Never contact the Hugging Face Hub (as HF_HUB_OFFLINE=1): Hub ids are taken from the local Hugging Face cache only."


def offline_flag(_ctx: object, _param: object, value: bool) -> None:
    """The click callback of `--offline`: `go_offline` before any option is used."""
    if value:
        go_offline()


def no_progress_bars() -> None:
    """No download progress bars (huggingface_hub's), for `--no-progress`."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def _timeout() -> float:
    try:
        return float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or 10)
    except ValueError:
        return 10.0


def _endpoint() -> str:
    """The Hub's URL: HF_ENDPOINT as set now (huggingface_hub reads it once, when imported)."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _page(ref: HubRef, repo_type: str) -> str:
    return f"{_endpoint()}/{'datasets/' if repo_type == 'dataset' else ''}{ref.repo_id}"


_RESOLVED: dict[tuple, tuple[Path, str]] = {}


def resolve(
    ref: HubRef, repo_type: str, what: str, *, allow_patterns: Sequence[str] | None = None, ignore_patterns: Sequence[str] | None = None
) -> tuple[Path, str]:
    """(local snapshot folder, commit hash) of `ref`: from the local Hugging Face cache, downloaded
    first when not there (and not offline). `what` names it in errors ("tokenizer", "model",
    "dataset"). Every failure is one UserError line. Resolved once per process (later calls return
    the same commit, so one run never mixes two)."""
    key = (ref.repo_id, ref.revision, repo_type, tuple(allow_patterns or ()), tuple(ignore_patterns or ()))
    if key not in _RESOLVED:
        _RESOLVED[key] = _resolve(ref, repo_type, what, allow_patterns, ignore_patterns)
    return _RESOLVED[key]


def _resolve(ref: HubRef, repo_type: str, what: str, allow: Sequence[str] | None, ignore: Sequence[str] | None) -> tuple[Path, str]:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub import errors as hf_errors
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    incomplete = getattr(hf_errors, "IncompleteSnapshotError", ())  # huggingface_hub 2.x
    transport = _transport_errors()

    name = ref.repo_id + (f"@{ref.revision}" if ref.revision else "")
    kwargs = dict(repo_type=repo_type, revision=ref.revision, allow_patterns=allow and list(allow), ignore_patterns=ignore and list(ignore))
    offline, unreachable = is_offline(), None
    try:
        if not offline and not (ref.revision and _COMMIT.match(ref.revision)):
            try:  # one bounded question first: a missing or gated repo fails here, in seconds
                HfApi(endpoint=_endpoint()).repo_info(ref.repo_id, repo_type=repo_type, revision=ref.revision, timeout=_timeout())
            except HfHubHTTPError as exc:
                if exc.response is None or exc.response.status_code < 500:
                    raise
                unreachable = f"it answered {exc.response.status_code}"  # the Hub is down: the cache may do
            except (*transport, OSError) as exc:  # no connection, DNS, timeout, proxy
                unreachable = one_line(exc) or type(exc).__name__
        folder = snapshot_download(
            ref.repo_id, local_files_only=offline or unreachable is not None, etag_timeout=_timeout(), endpoint=_endpoint(), **kwargs
        )
    except RevisionNotFoundError:
        raise UserError(
            f"{what} {ref.repo_id} has no revision {ref.revision!r} on the Hugging Face Hub: "
            f"give an existing branch, tag or commit after '@' (see {_page(ref, repo_type)})"
        ) from None
    except (GatedRepoError, RepositoryNotFoundError, HfHubHTTPError) as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(exc, GatedRepoError) or status in (401, 403):
            raise UserError(
                f"{what} {name}: the Hugging Face Hub refused access ({status or 'gated'}): it is gated or "
                "private: log in with `hf auth login` or set HF_TOKEN, and accept the license at "
                f"{_page(ref, repo_type)}"
            ) from None
        if isinstance(exc, RepositoryNotFoundError) or status == 404:
            raise UserError(
                f"{what} {name} is neither a local path nor a {repo_type} repo on the Hugging Face "
                f"Hub ({_endpoint()} answered 404): check the name (a local path: start it with ./)"
            ) from None
        raise UserError(f"{what} {name}: the Hugging Face Hub answered {status}: {one_line(exc)[:200]}; try again later") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        from huggingface_hub import constants

        if offline:
            why = "downloads are off (--offline / HF_HUB_OFFLINE=1)"
        elif unreachable:
            why = f"the Hugging Face Hub cannot be reached ({unreachable[:120]})"
        else:
            why = one_line(exc)[:200]
        where = "only partly in" if incomplete and isinstance(exc, incomplete) else "not in"
        raise UserError(
            f"{what} {name} is {where} the local Hugging Face cache ({constants.HF_HUB_CACHE}) "
            f"and {why}: download it once online (hf download {ref.repo_id}"
            f"{' --repo-type dataset' if repo_type == 'dataset' else ''}) or pass a local path"
        ) from None
    except transport as exc:  # the connection failed during the download itself
        raise UserError(
            f"{what} {name}: downloading from the Hugging Face Hub failed ({one_line(exc)[:160]}): "
            "run again (files already downloaded are kept in the cache), or pass a local path"
        ) from None
    folder = Path(folder)
    return folder, folder.name


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The network failures of the HTTP client huggingface_hub uses (httpx2 for 2.x, httpx for 1.x,
    requests before)."""
    found: list[type[BaseException]] = []
    for module, name in (
        ("httpx2", "TransportError"),
        ("httpx", "TransportError"),
        ("requests", "ConnectionError"),
        ("requests", "Timeout"),
    ):
        try:
            found.append(getattr(__import__(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def record(ref: HubRef, commit: str) -> dict:
    """What a manifest records of a Hub-named thing: the id, the revision asked for, the commit used."""
    return {"id": ref.repo_id, "revision": ref.revision, "commit": commit}


def pinned_input(facts: dict) -> str:
    """The input a manifest's `hub` facts of one file name (`pipeline.read.sources`), at the commit
    that was read: `org/name@commit[:config]:split`, or for files of the repo
    `hf://datasets/org/name@commit/PATH` (with the share of its rows, `:train[...]`, if any)."""
    if facts.get("data_files"):
        split = str(facts.get("split") or "")
        tail = f":{split}" if "[" in split else ""
        return f"{HF_FILES}{facts['id']}@{facts['commit']}/{facts['data_files']}{tail}"
    return HubRef(facts["id"], None, facts.get("config"), facts.get("split")).pinned(facts["commit"])


def changed_revision(what: str, ref: HubRef, commit: str, recorded: dict | None) -> str | None:
    """One line naming a commit of `ref` that differs from the one `recorded` (a manifest's), else None."""
    if not isinstance(recorded, dict) or recorded.get("id") != ref.repo_id or not recorded.get("commit"):
        return None
    if recorded["commit"] == commit:
        return None
    return (
        f"{what} {ref.repo_id} is at commit {commit[:12]} now, but the data was packed with commit "
        f"{str(recorded['commit'])[:12]}: pass {ref.repo_id}@{recorded['commit']} to use the same files"
    )


# data files a dataset repo may hold that the project reads (`pipeline.read.sources.EXTENSIONS`)
DATA_PATTERNS = [
    "*.parquet",
    "*.pq",
    "*.jsonl",
    "*.jsonl.gz",
    "*.ndjson",
    "*.json",
    "*.json.gz",
    "*.csv",
    "*.csv.gz",
    "*.tsv",
    "*.tsv.gz",
    "*.arrow",
    "*.jsonl.zst",
    "*.json.zst",
    "*.csv.zst",
    "*.tsv.zst",
]


def dataset_files(ref: HubRef) -> tuple[list[str], str]:
    """(the data files of `ref`'s config and split, sorted; the commit hash): the repo's files are
    chosen as `datasets.load_dataset` chooses them (the `configs:` section of the dataset card's YAML
    when it has one, else the Hub's file-name conventions such as `data/train-*.parquet`, through
    `datasets`' own pattern functions), from the cache or downloaded (only that split's files when
    the card lists them)."""
    card_folder, commit = resolve(ref, "dataset", "dataset", allow_patterns=["README.md"])
    pinned = HubRef(ref.repo_id, commit, ref.config, ref.split)
    base, patterns, listed = _split_patterns(pinned, card_folder)
    split = ref.split or "train"
    allow = (
        ["README.md", *(_repo_pattern(base, card_folder, p) for p in patterns[split])]
        if listed and split in patterns
        else ["README.md", *DATA_PATTERNS]
    )
    folder, _ = resolve(pinned, "dataset", "dataset", allow_patterns=allow)
    base_dir, patterns, _ = _split_patterns(pinned, folder)
    from datasets.data_files import DataFilesDict
    from datasets.exceptions import DataFilesNotFoundError

    if split not in patterns:
        raise UserError(
            f"dataset {ref.repo_id}{_config_name(ref)} has no split {split!r}: choose one of "
            f"{', '.join(sorted(patterns))} ({ref.repo_id}:SPLIT)"
        )
    try:
        files = DataFilesDict.from_patterns({split: patterns[split]}, base_path=str(base_dir))[split]
    except (DataFilesNotFoundError, FileNotFoundError) as exc:
        raise UserError(
            f"dataset {ref.repo_id}{_config_name(ref)} split {split!r}: its files are not in {folder} ({one_line(exc)[:160]})"
        ) from None
    readme = str(folder / "README.md")
    files = sorted(str(f) for f in files if str(f) != readme)
    for file in files:  # what a pattern matched, links followed, stays in the repo's cache folder
        contained(folder, os.path.relpath(file, folder), f"dataset {ref.repo_id} split {split!r} file", root=_repo_root(folder))
    return files, commit


def repo_files(ref: HubRef, pattern: str) -> tuple[list[str], str]:
    """(the files of dataset repo `ref` that `pattern`, a path in the repo or a glob, matches, sorted;
    the commit hash): downloaded alone when not in the cache, as `datasets.load_dataset(repo_id,
    data_files=pattern)` takes them. None may lead outside the repo."""
    where = f"dataset {ref.repo_id} data_files"
    if escape(pattern) is not None:  # before anything is asked for
        raise UserError(f"{where} is {pattern!r}: {escape(pattern)}; name a file inside the repo")
    folder, commit = resolve(ref, "dataset", "dataset", allow_patterns=[pattern])
    files = sorted(str(p) for p in folder.glob(pattern) if p.is_file())
    if not files:
        raise UserError(f"dataset {ref.repo_id} has no file {pattern!r} (in {folder}): check its path in the repo")
    for file in files:
        contained(folder, os.path.relpath(file, folder), where, root=_repo_root(folder))
    return files, commit


def _repo_root(snapshot: Path) -> Path:
    """The folder a snapshot's files may resolve into: the repo's cache folder (its files are links to
    `../../blobs/`), or the snapshot itself when it is not in the cache layout."""
    return snapshot.parent.parent if snapshot.parent.name == "snapshots" else snapshot


def _config_name(ref: HubRef) -> str:
    return f" config {ref.config!r}" if ref.config else ""


def _repo_pattern(base: Path, folder: Path, pattern: str) -> str:
    rel = os.path.relpath(base, folder)
    return pattern if rel == "." else f"{Path(rel).as_posix()}/{pattern}"


def _split_patterns(ref: HubRef, folder: Path) -> tuple[Path, dict[str, list[str]], bool]:
    """(the folder the patterns are relative to, split -> file patterns, whether the card listed
    them) of `ref`'s config in the snapshot `folder`: the data_files of the card's `configs:`, else
    the Hub's file-name conventions applied to the files present."""
    from datasets.data_files import EmptyDatasetError, get_data_patterns, sanitize_patterns
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard, DatasetCardData

    readme = folder / "README.md"
    try:
        card = DatasetCard.load(readme).data if readme.is_file() else DatasetCardData()
        configs = MetadataConfigs.from_dataset_card_data(card)
    except Exception as exc:  # noqa: BLE001 - a malformed card: YAML, ValueError, ...
        raise UserError(f"dataset {ref.repo_id}: cannot read the configs of its card {readme} ({one_line(exc)[:160]})") from None
    base = folder
    if configs:
        name = ref.config or configs.get_default_config_name() or (next(iter(configs)) if len(configs) == 1 else None)
        if name not in configs:
            raise UserError(
                f"dataset {ref.repo_id} has configs {', '.join(configs)}: name one as "
                f"{ref.repo_id}:CONFIG:SPLIT" + (f" ({ref.config!r} is none of them)" if ref.config else "")
            )
        params = configs[name]
        card_at = f"dataset {ref.repo_id}: the card's config {name!r}"
        base = contained(folder, params["data_dir"], f"{card_at} data_dir", root=_repo_root(folder)) if params.get("data_dir") else folder
        if params.get("data_files") is not None:
            patterns = sanitize_patterns(params["data_files"])
            for split_patterns in patterns.values():
                for pattern in split_patterns:
                    contained(base, pattern.replace("*", "x"), f"{card_at} data_files", root=_repo_root(folder))
            return base, patterns, True
    elif ref.config and ref.config != "default":
        base = contained(folder, ref.config, f"dataset {ref.repo_id}: config", root=_repo_root(folder))
        if not base.is_dir():
            raise UserError(f"dataset {ref.repo_id} declares no configs and has no folder {ref.config!r}: give {ref.repo_id}:SPLIT")
    try:
        return base, get_data_patterns(str(base)) if base.is_dir() else {}, False
    except EmptyDatasetError:
        return base, {}, False

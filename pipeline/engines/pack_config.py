"""`PackConfig`: every option of `pack-data`, each declared once (`pipeline.option_checks.opt`: its
type, default, range or choices, help and section; the input-format options are `FormatOptions`'),
from which pack-data's click options (`pipeline.cli`), the checks of `validate` and of
`pack-data --config FILE` values (`PACK_CHECKS`) and the README's option tables
(`python -m pipeline.option_checks pack-data`) are generated. `refuse_combinations` is the one
place where options that contradict each other are refused."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import UserError
from pipeline.option_checks import MAX_PROCS, PATH, PATHS, checks_of, opt
from pipeline.plan.binpack import MAX_LEN_LIMIT, STRATEGIES
from pipeline.plan.rows import OVERLONG
from pipeline.read.formats import FORMAT, FormatOptions
from pipeline.shards import MAX_SHARD_TOKENS
from pipeline.tokenize.chat_templates import NAMED as NAMED_TEMPLATES

ENGINES = ("local", "ray")
FILES, TOKENIZER, PACKING, EXAMPLES, WORK = "Input and output", "Tokenizer", "Packing", "Examples", "Execution"


@dataclass(kw_only=True)
class PackConfig(FormatOptions):
    """Every option of `pack-data` (recorded verbatim as the manifest's `config`): the format
    options it inherits plus the job's own, declared once (see the module)."""

    SECTIONS = (FILES, FORMAT, TOKENIZER, PACKING, EXAMPLES, WORK)  # the --help and README order

    # fmt: off
    # A table, one declaration an option (as TrainConfig's): ruff format would give every argument a line.
    inputs: list[str] = opt(kind=PATHS, cli=False, section=FILES, help="The data to pack (INPUT... of pack-data).")
    tokenizer: str = opt(kind=PATH, section=FILES, help=(
        "Tokenizer folder (tokenizer.json), or a Hugging Face Hub id such as meta-llama/Llama-2-7b-hf "
        "(org/name[@revision]): from the local Hugging Face cache, downloaded there when missing."))
    max_len: int = opt(low=2, high=MAX_LEN_LIMIT, section=FILES, help=(
        "Tokens per packed row (e.g. 8192; up to 16777216, e.g. 1048576 for examples of a million tokens)."))
    out: str = opt(kind=PATH, section=FILES, help=(
        "Output folder (must not exist unless --overwrite), or a URI (s3://, gs://, "
        "hdfs://, file://): written locally, then uploaded with manifest.json last."))
    strategy: str = opt("ffd", choices=STRATEGIES, show_default=True, section=PACKING,
                        help="Bin-packing strategy of the planner.")
    group_size: int = opt(32, low=1, show_default=True, section=PACKING,
                          help="Examples per group of --strategy minibatch.")
    overlong: str = opt("truncate", choices=OVERLONG, show_default=True, section=PACKING, help=(
        "What to do with an example longer than --max-len: cut it, split it into max-len pieces, "
        "drop it, or stop with an error naming its row. Counted in the manifest."))
    # pipeline.plan.dedup; Axolotl's dataset_exact_deduplication (pipeline.foreign.config)
    dedup: bool = opt(False, show_default=True, section=PACKING, help=(
        "Drop the examples whose tokens and labels equal an earlier example's (after --min-len and "
        "--overlong; Axolotl's dataset_exact_deduplication). Counted in the manifest and the summary."))
    # pipeline.plan.rows.apply_overlong; Axolotl's min_sample_len (pipeline.foreign.config)
    min_len: int = opt(1, low=1, high=MAX_LEN_LIMIT, show_default=True, section=PACKING, help=(
        "Drop the examples of fewer tokens than this (their whole tokenized length, before --overlong; "
        "1 keeps every example). Counted in the manifest and the summary."))
    # tokenizer worker processes; None: every usable CPU, at most 16
    num_proc: int | None = opt(None, low=1, high=MAX_PROCS, section=WORK, help=(
        "Tokenizer worker processes (output is identical for any value). Default: every CPU this "
        "process may use, at most 16; 1 tokenizes in this process."))
    seed: int = opt(0, low=0, show_default=True, section=PACKING, help="Seed of the planner's random choices.")
    rows_per_shard: int | None = opt(None, low=1, section=PACKING,
                                     help="Packed rows per shard file. Default: about 128 MiB per shard.")
    overwrite: bool = opt(False, section=FILES, help="Replace --out if it exists (only a folder written by pack-data).")
    limit: int | None = opt(None, low=1, section=EXAMPLES,
                            help="Read only the first N examples (to try options on a slice).")
    # "a.jsonl=2,b.parquet=0.5": uses per example of each input (pipeline.plan.mix)
    mix: str | None = opt(None, metavar="NAME=W,...", section=EXAMPLES, help=(
        "Dataset mixture: how many times each example of an input is used, e.g. 'a.jsonl=2,b.parquet=0.5' "
        "(2: every example twice; 0.5: a seeded half). NAME is an INPUT as given or a file's name; "
        "inputs left out use 1. Recorded per input in the manifest."))
    # held out into OUT/eval (pipeline.plan.eval_split)
    eval_fraction: float | None = opt(None, low=0, high=1, low_open=True, high_open=True, section=EXAMPLES, help=(
        "Hold out this fraction of the examples (seeded by --seed, the same for any --num-proc) "
        "into OUT/eval, a packed folder of its own that pack-train evaluates on."))
    eval_examples: int | None = opt(None, low=1, section=EXAMPLES, help="Hold out this many examples instead.")
    # None: pipeline.tokenize.tokenize_inputs's default for the input's format
    batch_rows: int | None = opt(None, low=1, section=WORK, help=(
        "Rows per tokenization batch. Default: 128 for text (enough batches for every "
        "worker), 4096 for pre-tokenized input."))
    engine: str = opt("local", choices=ENGINES, show_default=True, section=WORK, help=(  # pipeline.engines.ray_engine
        "Where the work runs: this machine, or Ray tasks (needs pip install 'packlm[ray]'); the shards "
        "are byte-identical. With ray, the inputs and --out's folder must be on storage every node "
        "mounts at the same path."))
    ray_address: str | None = opt(None, metavar="HOST:PORT", section=WORK, help=(
        "Ray cluster to run on (--engine ray). Default: $RAY_ADDRESS, else a local Ray of --num-proc "
        "CPUs started for the job."))
    # None: ray_engine.default_chunk_bytes
    chunk_bytes: int | None = opt(None, low=1, section=WORK, help=(
        "Input bytes per Ray tokenize task (JSONL is cut at line ends, Parquet at row groups, Arrow "
        "files at record batches; other inputs are one task each). Default: 4 chunks per CPU of the "
        "cluster, from 1 MiB to 64 MiB each."))
    tmp_dir: str | None = opt(None, kind=PATH, section=WORK, help=(  # pipeline.write.remote_out
        "Where a remote --out is written before its upload (on a Ray cluster: storage every node sees). "
        "Default: the system's temporary folder."))
    # a name, Jinja file or text (pipeline.tokenize.chat_templates); None: the tokenizer's
    chat_template: str | None = opt(None, metavar="NAME|FILE", section=TOKENIZER, help=(
        f"Chat template that renders chat data instead of the tokenizer's own (or for a tokenizer "
        f"without one): {', '.join(NAMED_TEMPLATES)}, or a Jinja file. Recorded in the manifest and "
        "the tokenizer fingerprint; pack-train gives the model's tokenizer the same template."))
    add_tokens: tuple[str, ...] = opt((), flags=("--add-token", "add_tokens"), multiple=True, metavar="TEXT",
                                      section=TOKENIZER, help=(
        "Add TEXT to the tokenizer as a new token (repeat it for several; Axolotl's tokens), e.g. a chat "
        "template's marker the vocabulary lacks; pack-train grows the model's embeddings to match."))
    special_tokens: dict[str, str] = opt(factory=dict, flags=("--special-token", "special_tokens"), multiple=True,
                                         metavar="NAME=TEXT", section=TOKENIZER, help=(
        "Set the tokenizer's special token NAME (eos_token, bos_token, pad_token, ...) to TEXT, added to "
        "the vocabulary when missing (repeat it; Axolotl's special_tokens), e.g. eos_token=<|im_end|>."))
    progress: bool = opt(True, show_default=True, section=WORK, help="Progress bars on stderr.")
    # fmt: on

    def format_options(self) -> FormatOptions:
        keys = FormatOptions.__dataclass_fields__
        return FormatOptions(**{k: getattr(self, k) for k in keys})


# the type and range of every PackConfig field (`validate`, and the values of `pack-data --config FILE`)
PACK_CHECKS = checks_of(PackConfig)


def refuse_combinations(config: PackConfig) -> None:
    """The one place for pack-data's options that contradict each other, whatever the data: a
    UserError naming both. (Run by `validate` after each option's own check, before the defaults
    that depend on the machine or --max-len are filled in: those never contradict.)"""
    if config.eval_fraction is not None and config.eval_examples is not None:
        raise UserError("give --eval-fraction or --eval-examples, not both")
    if config.dedup and config.overlong == "split":
        raise UserError(
            "--dedup compares whole examples and --overlong split cuts them into pieces: use --overlong "
            "truncate, drop or error with --dedup"
        )
    if config.rows_per_shard is not None and config.rows_per_shard * config.max_len > MAX_SHARD_TOKENS:
        raise UserError(
            f"--rows-per-shard {config.rows_per_shard} at --max-len {config.max_len} lets one shard hold up to "
            f"{config.rows_per_shard * config.max_len:,} tokens, more than the {MAX_SHARD_TOKENS:,} its int32 list "
            f"offsets address: use --rows-per-shard {MAX_SHARD_TOKENS // config.max_len} or fewer"
        )

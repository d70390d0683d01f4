"""`pack-data`: tokenize a dataset and write bin-packed Arrow shards (thin wrapper over run_pack_data).

Its console script is `pipeline.console.pack_data_main`, which starts loading the tokenizer first.
"""

from __future__ import annotations

import click

from pipeline.binpack import STRATEGIES
from pipeline.errors import cli_errors
from pipeline.formats import FORMATS, TEMPLATES
from pipeline.tokenize import OVERLONG
from pipeline.write import PackConfig, run_pack_data

EPILOG = """\b
Examples:
  pack-data data/sample/instructions.jsonl --tokenizer data/tokenizer --max-len 8192 --out out/sample
  pack-data 'corpus/*.parquet' --tokenizer ../shared/tokenizers/llama2 --max-len 4096 \\
      --format text --text-field body --num-proc 8 --out out/corpus --overwrite
  pack-data data/sample/chat.jsonl --tokenizer data/tokenizer --max-len 2048 --out out/chat --limit 100
"""


@click.command(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=EPILOG,
)
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option("--tokenizer", required=True,
              help="Tokenizer folder (tokenizer.json) or Hub name. What a job loads of a local folder is "
                   "cached (PACKLM_CACHE_DIR, default ~/.cache/packlm; set it empty to turn this off), "
                   "so later jobs with the same files skip loading it.")
@click.option("--max-len", type=int, required=True, help="Tokens per packed row (e.g. 8192).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output folder (must not exist unless --overwrite).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="auto", show_default=True,
              help="Input format; auto looks at column names: input_ids -> tokenized, messages -> chat, "
                   "instruction/output, prompt/completion, question/answer -> instruction, text -> text.")
@click.option("--text-field", default=None, help="Column with the documents (text format). Auto: text, content, document.")
@click.option("--prompt-field", default=None, help="Column with the prompt/instruction. Auto: instruction, prompt, question, query.")
@click.option("--input-field", default=None, help="Optional extra-context column of instruction data. Auto: input.")
@click.option("--response-field", default=None, help="Column with the response. Auto: output, response, completion, answer.")
@click.option("--messages-field", default=None, help="Column with chat messages [{role, content}]. Auto: messages, conversations.")
@click.option("--labels-field", default=None, help="Column with labels for tokenized input. Auto: labels (else loss on all tokens).")
@click.option("--template", default=None,
              help=f"Prompt template of instruction data: a preset ({', '.join(TEMPLATES)}) or a Python format "
                   "string with {instruction} or {prompt}, and optionally {input}. Default: alpaca for "
                   "instruction/output, qa for question/answer, plain otherwise.")
@click.option("--train-on-prompt", is_flag=True, help="Also take loss on prompts / non-assistant turns (default: responses and assistant turns only).")
@click.option("--strategy", type=click.Choice(STRATEGIES), default="ffd", show_default=True, help="Bin-packing strategy of the planner.")
@click.option("--group-size", type=int, default=32, show_default=True, help="Examples per group of --strategy minibatch.")
@click.option("--overlong", type=click.Choice(OVERLONG), default="truncate", show_default=True,
              help="What to do with an example longer than --max-len: cut it, split it into max-len pieces, "
                   "drop it, or stop with an error naming its row. Counted in the manifest.")
@click.option("--num-proc", type=click.IntRange(min=1), default=None,
              help="Tokenizer worker processes (output is identical for any value). Default: every CPU this "
                   "process may use, at most 16; 1 tokenizes in this process.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the planner's random choices.")
@click.option("--rows-per-shard", type=int, default=None, help="Packed rows per shard file. Default: about 128 MiB per shard.")
@click.option("--overwrite", is_flag=True, help="Replace --out if it exists (only a folder written by pack-data).")
@click.option("--limit", type=int, default=None, help="Read only the first N examples (to try options on a slice).")
@click.option("--batch-rows", type=int, default=None, help="Rows per tokenization batch. Default: 128 for text (enough batches for every "
                   "worker), 4096 for pre-tokenized input.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bars on stderr.")
def pack_data(inputs: tuple[str, ...], tokenizer: str, max_len: int, out: str, fmt: str, **options: object) -> None:
    """Tokenize INPUT... (JSONL, JSON, Parquet, Arrow, CSV, save_to_disk folders, globs) and write
    bin-packed Arrow shards plus manifest.json to --out.

    Every example starts with BOS and ends with EOS; loss is taken on responses / assistant turns
    (all tokens of plain text), never on the first token of an example. Rows hold no padding;
    position_ids restart per example. The output folder appears only when complete.
    """
    with cli_errors():
        config = PackConfig(inputs=list(inputs), tokenizer=tokenizer, max_len=max_len, out=out, format=fmt, **options)  # type: ignore[arg-type]
        run_pack_data(config, echo=click.echo)

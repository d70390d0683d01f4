"""pipeline.tokenize.batch and pipeline.tokenize.tokenize_inputs: BOS/EOS and labels per format, pre-tokenized input,
segments, worker processes, batches in input order."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.errors import UserError
from pipeline.read.formats import FormatOptions, detect_format
from pipeline.read.sources import resolve_inputs
from pipeline.shards import IGNORE_INDEX
from pipeline.tokenize.batch import encode_texts, tokenize_batch, tokenized_batch
from pipeline.tokenize.encode_pool import encode_pool
from pipeline.tokenize.render import rows_where
from pipeline.tokenize.segments import cached_token_sizes, encode_segments, token_sizes
from pipeline.tokenize.spill import _map_pieces
from pipeline.tokenize.tokenize_inputs import TEXT_BATCH_ROWS, iter_tokenized, lengths_of
from pipeline.tokenize.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER = ROOT / "data" / "tokenizer"
LLAMA2 = ROOT.parent / "shared" / "tokenizers" / "llama2"  # real data beside the checkout; skipped without it
BOS, EOS = 1, 2


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(TOKENIZER))


def enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def split(batch) -> list[tuple[list[int], list[int]]]:
    """Per-example (ids, labels) of a TokBatch (empty examples included as empty lists)."""
    out, k = [], 0
    for n in batch.lengths:
        out.append((batch.input_ids[k : k + n].tolist(), batch.labels[k : k + n].tolist()))
        k += n
    return out


def test_text_bos_eos_and_loss_on_everything_but_the_first_token(tok):
    table = pa.table({"text": ["hello world", "   ", "second document"]})
    fmt = detect_format(table.column_names, FormatOptions())
    ex = split(tokenize_batch(table, fmt, tok, rows_where("t.jsonl")))
    body = enc(tok, "hello world")
    assert ex[0][0] == [BOS, *body, EOS]
    assert ex[0][1] == [IGNORE_INDEX, *body, EOS]  # the EOS carries loss: the model learns to stop
    assert ex[1] == ([], [])  # blank text -> empty example (skipped, counted by the writer)
    assert ex[2][0] == [BOS, *enc(tok, "second document"), EOS]


def test_instruction_loss_only_on_response_and_its_eos(tok):
    table = pa.table({"question": ["What is 2+2?"], "answer": ["4"]})
    fmt = detect_format(table.column_names, FormatOptions())
    ((ids, labels),) = split(tokenize_batch(table, fmt, tok, rows_where("q.jsonl")))
    prompt = enc(tok, "Question: What is 2+2?\nAnswer:\n")
    response = enc(tok, "4")
    assert ids == [BOS, *prompt, *response, EOS]
    assert labels == [IGNORE_INDEX] * (1 + len(prompt)) + response + [EOS]
    fmt = detect_format(table.column_names, FormatOptions(train_on_prompt=True))
    ((ids2, labels2),) = split(tokenize_batch(table, fmt, tok, rows_where("q.jsonl")))
    assert ids2 == ids and labels2 == [IGNORE_INDEX, *ids[1:]]


def test_chat_loss_on_assistant_turns_and_the_templates_ids_as_they_are(tok):
    """A chat is its template's rendering tokenized as apply_chat_template tokenizes it: no BOS where
    the template writes none (pack-data adds one to text), no EOS after it."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    table = pa.table({"messages": [msgs]})
    fmt = detect_format(table.column_names, FormatOptions())
    ((ids, labels),) = split(tokenize_batch(table, fmt, tok, rows_where("c.jsonl")))
    assert ids == tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
    text = pa.table({"text": ["Hi"]})
    ((text_ids, _),) = split(tokenize_batch(text, detect_format(text.column_names, FormatOptions()), tok, rows_where("t")))
    assert BOS not in ids and EOS not in ids and text_ids[0] == BOS  # control: text gets one
    trained = [t for t in labels if t != IGNORE_INDEX]
    assert tok.decode(trained) == "Hello there<|im_end|>"  # its generation block: not the "\n" after it


def test_tokenized_input_labels_derived_or_given(tok):
    table = pa.table({"input_ids": [[5, 6, 7], [], [8, 9]]})
    fmt = detect_format(table.column_names, FormatOptions())
    ex = split(tokenized_batch(table, fmt, rows_where("x.parquet")))
    assert ex == [([5, 6, 7], [IGNORE_INDEX, 6, 7]), ([], []), ([8, 9], [IGNORE_INDEX, 9])]
    table = pa.table({"input_ids": [[5, 6, 7]], "labels": [[5, -100, 7]]})
    ex = split(tokenized_batch(table, detect_format(table.column_names, FormatOptions()), rows_where("x")))
    assert ex == [([5, 6, 7], [IGNORE_INDEX, IGNORE_INDEX, 7])]


@pytest.mark.parametrize(
    ("columns", "needle"),
    [
        ({"input_ids": [[1, 2], [3]], "labels": [[1, 2], [3, 4]]}, "x.arrow row 2: labels has 2 entries"),
        ({"input_ids": [[1, 2]], "labels": [[1, 5]]}, "labels must be -100 or equal"),
        ({"input_ids": [[1, 2], None]}, "x.arrow row 2: 'input_ids' is missing or null"),
        ({"input_ids": [[1, -4]]}, "negative id"),
        ({"input_ids": ["a b"]}, "expected a list of token ids"),
    ],
)
def test_tokenized_input_errors(columns, needle):
    table = pa.table(columns)
    fmt = detect_format(table.column_names, FormatOptions(format="tokenized"))
    with pytest.raises(UserError, match=needle):
        tokenized_batch(table, fmt, rows_where("x.arrow"))


PAIRS = [  # prompt, response: cuts after a space, inside a word, before and after newlines, bytes
    ("Answer: ", "Hello world"),
    ("Question: How many apples?\nAnswer:\n", "Natalia sold 48 apples."),
    ("x = ", "1"),
    ("Write the code", "ing part"),
    ("### Response:\n", "\n\nSure"),
    ("naïve café ", "🙂 ok"),
    ("", "only a response"),
    ("only a prompt", ""),
]


def _load_or_skip(folder: Path):
    if not folder.is_dir():
        pytest.skip(f"{folder} is not here")
    return load_tokenizer(str(folder))


def _first_token_after(tok, text: str, char: int) -> int:
    """Index of the first token of `text` that ends after `char` (offsets of the whole text)."""
    ends = [end for _, end in tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
    return next((i for i, end in enumerate(ends) if end > char), len(ends))


@pytest.mark.parametrize("folder", [TOKENIZER, LLAMA2], ids=["data-tokenizer", "llama2"])
def test_an_example_is_encoded_whole_and_its_loss_starts_at_the_token_holding_the_response(folder: Path):
    """The ids are the tokenizer's ids of the whole rendered text, as a model sees it (a
    SentencePiece tokenizer would start a response encoded alone with "▁", a byte-level one loses
    merges across the cut); the token that straddles prompt and response carries loss."""
    tk = _load_or_skip(folder)
    table = pa.table({"prompt": [p for p, _ in PAIRS], "response": [r for _, r in PAIRS]})
    fmt = detect_format(table.column_names, FormatOptions())
    assert fmt.template == "{prompt}"
    got = split(tokenize_batch(table, fmt, tk, rows_where("t.jsonl")))
    bos, eos = tk.bos_token_id, tk.eos_token_id
    for (prompt, response), (ids, labels) in zip(PAIRS, got):
        whole = enc(tk, prompt + response)
        assert ids == [bos, *whole, eos]
        assert tk.decode(ids[1:-1]) == prompt + response  # no space or byte the data lacks
        cut = _first_token_after(tk, prompt + response, len(prompt))
        assert labels == [IGNORE_INDEX] * (1 + cut) + whole[cut:] + [eos]


PIECES = ["a", "b", "ab", " ", "  ", "é", "\n", "🙂", ".", ":", "x = ", "▁", "<s>", "<unk>", "\t"]


@pytest.fixture(scope="module", params=[TOKENIZER, LLAMA2], ids=["data-tokenizer", "llama2"])
def any_tok(request):
    return _load_or_skip(request.param)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.lists(st.sampled_from(PIECES), max_size=5).map("".join), min_size=1, max_size=4), min_size=1, max_size=6))
def test_segments_split_the_whole_texts_ids_at_their_cuts(any_tok, examples: list[list[str]]):
    """encode_segments: the ids of every whole text, cut into segments whose token counts add up
    and whose first token is the first one to end after the cut; the same from the ids' byte sizes
    (texts whose sizes do not add up, such as those holding an added token that strips spaces or
    an unknown token, are measured with offsets) as from the tokenizer's offsets."""
    backend = any_tok.backend_tokenizer
    texts = ["".join(segs) for segs in examples]
    counts = np.array([len(segs) - 1 for segs in examples], dtype=np.int64)
    positions = np.array([sum(map(len, segs[:k])) for segs in examples for k in range(1, len(segs))], dtype=np.int64)
    flat, seg_lens = encode_segments(backend, texts, (counts, positions))
    sizes = cached_token_sizes(backend)
    assert sizes is not None  # both tokenizers are measured from their ids
    sized = encode_segments(backend, texts, (counts, positions), sizes)
    assert np.array_equal(sized[0], flat) and np.array_equal(sized[1], seg_lens)
    assert flat.tolist() == [i for t in texts for i in enc(any_tok, t)]
    assert len(seg_lens) == sum(map(len, examples)) and (seg_lens >= 0).all()
    k = 0
    for text, segs in zip(texts, examples):
        mine = seg_lens[k : k + len(segs)].tolist()
        assert sum(mine) == len(enc(any_tok, text))
        starts = np.cumsum([0, *mine[:-1]]).tolist()
        for j in range(1, len(segs)):
            cut = sum(map(len, segs[:j]))
            if cut < len(text):
                assert starts[j] == _first_token_after(any_tok, text, cut)
        k += len(segs)


def test_tokenizers_whose_ids_do_not_tell_their_text_length_are_measured_with_offsets(tok):
    """A normalizer that may change lengths (NFKC, lowercasing) or a prefix space: no sizes."""
    from tokenizers import Tokenizer

    spec = json.loads(tok.backend_tokenizer.to_str())
    for change in (
        {"normalizer": {"type": "NFKC"}},
        {"normalizer": {"type": "Lowercase"}},
        {"pre_tokenizer": {**spec["pre_tokenizer"], "add_prefix_space": True}},
    ):
        assert token_sizes(Tokenizer.from_str(json.dumps({**spec, **change}))) is None


def test_texts_whose_sizes_do_not_add_up_are_cut_by_offsets_in_workers_too(tok):
    """An unknown token's size is unknown: that text is measured with offsets, the others from their
    ids; worker processes give what this process gives."""
    from pipeline.tokenize.segments import _split_by_sizes, flat_ids

    texts = ["Answer: <unk> yes", "Answer: fine", "plain"]
    cuts = (np.array([1, 1, 0]), np.array([8, 8]))
    sizes = cached_token_sizes(tok.backend_tokenizer)
    flat, lens = flat_ids(tok.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False))
    assert _split_by_sizes(sizes, flat, lens, texts, *cuts)[1].tolist() == [False, True, True]
    want = encode_segments(tok.backend_tokenizer, texts, cuts)  # all by offsets
    got = encode_texts(tok, texts, cuts)
    assert np.array_equal(got[0], want[0]) and got[1].tolist() == want[1].tolist()
    # the cut is after "Answer: ": the token "Ġfine", which holds that space, goes with the response
    assert want[1].tolist()[2:4] == [len(enc(tok, "Answer:")), len(enc(tok, " fine"))] == [2, 1]
    from pipeline.tokenize.encode_pool import EncodePool

    pool = EncodePool(2, tok.backend_tokenizer.to_str())
    try:
        for _ in range(2):  # every worker
            from_workers = pool.encode(texts, cuts)
            assert np.array_equal(from_workers[0], want[0]) and np.array_equal(from_workers[1], want[1])
    finally:
        pool.close()


def test_nfc_and_space_stripping_added_tokens_leave_only_texts_the_sizes_can_measure(tok):
    """With an NFC normalizer, only texts already in NFC are measured from their ids (NFC may
    lengthen one char and shorten another); an added token that strips the spaces beside it sends
    its texts to offsets too. Either way the cuts are the offsets' cuts."""
    from tokenizers import AddedToken, Tokenizer

    from pipeline.tokenize.segments import _split_by_sizes, flat_ids

    spec = json.loads(tok.backend_tokenizer.to_str())
    backend = Tokenizer.from_str(json.dumps({**spec, "normalizer": {"type": "NFC"}}))
    backend.add_special_tokens([AddedToken("<sep>", lstrip=True)])
    sizes = token_sizes(backend)
    assert sizes is not None and sizes.nfc
    texts = ["Ohm \u2126 and e\u0301 here", "plain text: yes", "\ufa6c and \u2126 x", "a   <sep> b", "a <s> b"]
    cuts = (np.ones(len(texts), dtype=np.int64), np.array([6, 6, 3, 2, 2]))
    flat, lens = flat_ids(backend.encode_batch_fast(texts, add_special_tokens=False))
    assert _split_by_sizes(sizes, flat, lens, texts, *cuts)[1].tolist() == [False, True, False, False, True]
    got, want = encode_segments(backend, texts, cuts, sizes), encode_segments(backend, texts, cuts)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_encode_texts_flat_matches_per_text(tok):
    texts = ["a b c", "", "δ unicode ✓"]
    flat, lens = encode_texts(tok, texts)
    assert lens.tolist() == [len(enc(tok, t)) for t in texts]
    assert flat.dtype == np.int32 and flat.tolist() == [i for t in texts for i in enc(tok, t)]


def test_lengths_of_counts_bos_and_eos(tok, tmp_path):
    path = tmp_path / "d.jsonl"
    texts = ["one", "two three four", "", "five"]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    got = lengths_of([str(path)], tok)
    assert got.tolist() == [len(enc(tok, t)) + 2 for t in texts if t]
    assert lengths_of(str(path), str(TOKENIZER), limit=2).tolist() == got[:2].tolist()


def test_workers_keep_input_order_locations_and_the_environment(tok, tmp_path, monkeypatch):
    """Text batches encoded by worker processes come back in input order with their own locations;
    an error names the right line; the tokenizer's own thread pool setting is restored after."""
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    rows = [{"text": f"example {i} " + "word " * (i % 7)} for i in range(TEXT_BATCH_ROWS * 2 + 30)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    files = resolve_inputs([str(path)])
    fmt = detect_format(["text"], FormatOptions())
    serial = list(iter_tokenized(files, fmt, tok, num_proc=1, batch_rows=4096))
    parallel = list(iter_tokenized(files, fmt, tok, num_proc=3))
    assert len(serial) == 1 and len(parallel) == 3  # default text batches: TEXT_BATCH_ROWS rows
    assert [b.first_index for b, _ in parallel] == [0, TEXT_BATCH_ROWS, 2 * TEXT_BATCH_ROWS]
    assert parallel[2][0].where(0) == f"{path} line {2 * TEXT_BATCH_ROWS + 1}"
    assert np.array_equal(np.concatenate([t.input_ids for _, t in parallel]), serial[0][1].input_ids)
    assert np.array_equal(np.concatenate([t.labels for _, t in parallel]), serial[0][1].labels)
    assert "TOKENIZERS_PARALLELISM" not in os.environ

    rows[TEXT_BATCH_ROWS + 5] = {"text": None}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match=f"d.jsonl line {TEXT_BATCH_ROWS + 6}: "):
        list(iter_tokenized(files, fmt, tok, num_proc=3))
    assert "TOKENIZERS_PARALLELISM" not in os.environ


def test_a_pool_forked_with_a_backend_encodes_with_it_and_can_switch(tok):
    """Workers that inherit a backend at the fork (a job whose tokenizer was cached) encode with it
    at once, take another one when told, and a backend they cannot build is the first encode's error."""
    from tokenizers import Tokenizer

    from pipeline.tokenize.encode_pool import EncodePool

    texts = ["hello world", "", "naïve café 😀 " * 3]
    backend = tok.backend_tokenizer.to_str()
    pool = EncodePool(2, backend)
    try:
        pool.use(backend)  # what they hold already
        for _ in range(3):  # every worker
            got = pool.encode(texts)
            want = encode_texts(tok, texts)
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        other = Tokenizer.from_str(backend)
        other.add_tokens(["zzqx"])
        pool.use(other)
        assert pool.encode(["zzqx"])[0].tolist() == [other.token_to_id("zzqx")]
    finally:
        pool.close()
    broken = EncodePool(1, "{not a tokenizer")
    try:
        with pytest.raises(RuntimeError, match="tokenizer worker failed"):
            broken.encode(texts)
    finally:
        broken.close()


def test_encode_pool_matches_the_tokenizer_switches_tokenizers_and_reports_a_dead_worker(tok):
    """Workers give exactly `encode_texts`'s ids, take a new tokenizer when told, are reused while
    alive, and a worker that died is one clear UserError, after which a fresh pool is forked."""
    from tokenizers import Tokenizer

    texts = ["hello world", "", "naïve café 😀 " * 3, "def f(x):\n    return x"]
    pool = encode_pool(2)
    pool.use(tok.backend_tokenizer)
    want = encode_texts(tok, texts)
    got = pool.encode(texts)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert encode_pool(2) is pool  # kept for the next job

    other = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    other.add_tokens(["zzqx"])  # another tokenizer: "zzqx" is one token here, several in `tok`
    pool.use(other)
    pool.use(tok.backend_tokenizer)  # handed over twice before any encode: the last one counts
    assert np.array_equal(pool.encode(["zzqx"])[0], encode_texts(tok, ["zzqx"])[0])
    pool.use(other)
    assert pool.encode(["zzqx"])[0].tolist() == [other.token_to_id("zzqx")]
    pool.use(tok.backend_tokenizer)
    assert np.array_equal(pool.encode(texts)[0], want[0])

    pool._procs[0].kill()
    pool._procs[0].join()
    with pytest.raises(UserError, match="tokenizer worker process exited unexpectedly"):
        for _ in range(2):  # one of the two workers is dead: at most two calls reach it
            pool.encode(texts)
    fresh = encode_pool(2)
    assert fresh is not pool and fresh.alive
    fresh.use(tok.backend_tokenizer)
    assert np.array_equal(fresh.encode(texts)[0], want[0])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=40),
    window_pages=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_spill_pieces_read_through_map_windows_equal_the_slices(tmp_path_factory, monkeypatch, sizes, window_pages, seed):
    """Any pieces of a spill file, in any order, some crossing window edges or ending at the file's
    end, come back concatenated in the order asked, whatever the window size."""
    import pipeline.tokenize.spill

    monkeypatch.setattr(pipeline.tokenize.spill, "MAP_WINDOW_BYTES", 4096 * window_pages)
    rng = np.random.default_rng(seed)
    data = rng.integers(-(2**31), 2**31 - 1, size=sum(sizes), dtype=np.int32)  # the last piece ends at the end
    path = tmp_path_factory.mktemp("spill") / "ids.bin"
    data.tofile(path)
    starts = np.cumsum(sizes) - np.asarray(sizes)
    order = rng.permutation(len(sizes))
    want = np.concatenate([data[starts[k] : starts[k] + sizes[k]] for k in order])
    fd = os.open(path, os.O_RDONLY)
    try:
        got = _map_pieces(fd, starts[order], np.asarray(sizes)[order])
        buffer = np.full(len(want) + 5, 7, np.int32)
        into = _map_pieces(fd, starts[order], np.asarray(sizes)[order], buffer)
    finally:
        os.close(fd)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(into, want)
    assert into.base is buffer or into.base is buffer.base  # read into the buffer given


def test_a_spill_file_shorter_than_its_pieces_is_an_os_error(tmp_path):
    path = tmp_path / "ids.bin"
    np.arange(10, dtype=np.int32).tofile(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="short read from the spill file"):
            _map_pieces(fd, np.array([8]), np.array([5]))
    finally:
        os.close(fd)


def test_a_spill_file_that_cannot_be_mapped_is_read_piece_by_piece(tmp_path, monkeypatch):
    import pipeline.tokenize.spill

    def refuse(*args, **kwargs):
        raise OSError(errno.ENODEV, "No such device")  # what a FUSE mount without mmap answers

    path = tmp_path / "ids.bin"
    data = np.arange(5000, dtype=np.int32)
    data.tofile(path)
    starts, lengths = np.array([4000, 10, 2000]), np.array([900, 5, 1000])
    fd = os.open(path, os.O_RDONLY)
    try:
        mapped = _map_pieces(fd, starts, lengths)
        monkeypatch.setattr(pipeline.tokenize.spill.mmap, "mmap", refuse)
        read = _map_pieces(fd, starts, lengths)
    finally:
        os.close(fd)
    want = np.concatenate([data[4000:4900], data[10:15], data[2000:3000]])
    np.testing.assert_array_equal(mapped, want)
    np.testing.assert_array_equal(read, want)


# ------------------------------------------------------------------------------------ long texts

LONG_PIECES = [*PIECES, "word", "Hello", " the", "ab cd", "</s>", "x y", "日本"]


@pytest.fixture
def small_limits(monkeypatch):
    """pipeline.tokenize.long_texts with limits a few chars long, so that short texts are cut into pieces."""
    import pipeline.tokenize.long_texts as lt

    for name, value in (("LONG_TEXT_CHARS", 16), ("PIECE_CHARS", 4), ("CALL_CHARS", 24), ("MAX_PIECE_CHARS", 1 << 20)):
        monkeypatch.setattr(lt, name, value)
    return lt


def _recording(encode):
    """`encode`, and the list of the texts of each of its calls."""
    calls: list[list[str]] = []

    def record(texts, cuts):
        calls.append(list(texts))
        return encode(texts, cuts)

    return record, calls


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.lists(st.lists(st.sampled_from(LONG_PIECES), max_size=12).map("".join), min_size=1, max_size=4), min_size=1, max_size=6),
    st.booleans(),
)
def test_long_texts_are_cut_only_where_no_id_changes(any_tok, small_limits, examples: list[list[str]], with_cuts: bool):
    """encode_bounded cuts texts longer than LONG_TEXT_CHARS into pieces and groups texts into calls
    of at most CALL_CHARS chars, and still gives the ids and segment lengths of every whole text
    (from offsets, the reference): the cut places the tokenizer's pipeline proves safe are safe."""
    from pipeline.tokenize.long_texts import cut_pattern, encode_bounded

    backend = any_tok.backend_tokenizer
    assert cut_pattern(backend) is not None  # both pipelines can be cut
    texts = ["".join(segs) for segs in examples]
    counts = np.array([len(segs) - 1 for segs in examples], dtype=np.int64)
    positions = np.array([sum(map(len, segs[:k])) for segs in examples for k in range(1, len(segs))], dtype=np.int64)
    cuts = (counts, positions) if with_cuts else None
    want = encode_segments(backend, texts, cuts)
    sizes = cached_token_sizes(backend)
    record, calls = _recording(lambda t, c: encode_segments(backend, t, c, sizes))
    got = encode_bounded(record, texts, cuts, lambda: backend, lambda i: f"row {i}")
    assert np.array_equal(got[0], want[0]) and got[1].tolist() == want[1].tolist()
    assert got[0].tolist() == [i for t in texts for i in enc(any_tok, t)]
    pieces = [p for call in calls for p in call]
    assert "".join(pieces) == "".join(texts)
    assert all(len(call) == 1 or sum(map(len, call)) <= small_limits.CALL_CHARS for call in calls)
    if sum(map(len, texts)) > small_limits.CALL_CHARS:  # (else one call, as for any batch that small)
        cuttable = [t for t in texts if len(t) > small_limits.LONG_TEXT_CHARS and cut_pattern(backend).search(t, 4)]
        assert len(pieces) >= len(texts) + len(cuttable)


def test_a_long_row_is_tokenized_in_calls_of_bounded_size_with_the_ids_of_its_whole_text(any_tok):
    """At the real limits: a row of more than LONG_TEXT_CHARS chars reaches the tokenizer as pieces
    of about PIECE_CHARS chars, in calls of at most CALL_CHARS chars (what bounds the tokenizer's
    memory), and its example holds the tokenizer's ids of the whole text."""
    from pipeline.tokenize import long_texts

    docs = [json.loads(line)["text"] for line in (ROOT / "data" / "sample" / "text.jsonl").read_text().splitlines()]
    long_text = " ".join(docs * (long_texts.LONG_TEXT_CHARS // len(" ".join(docs)) + 1))
    assert len(long_text) > long_texts.LONG_TEXT_CHARS
    table = pa.table({"text": ["a short one", long_text, "another"]})
    fmt = detect_format(table.column_names, FormatOptions())
    record, calls = _recording(lambda t, c: encode_texts(any_tok, t, c))
    batch = tokenize_batch(table, fmt, any_tok, rows_where("t.jsonl"), record)
    assert max(sum(map(len, call)) for call in calls) <= long_texts.CALL_CHARS
    assert max(len(p) for call in calls for p in call) < 2 * long_texts.PIECE_CHARS
    assert len(calls) > 1
    whole = any_tok.backend_tokenizer.encode(long_text, add_special_tokens=False).ids
    ids = split(batch)[1][0]
    assert ids[1:-1] == whole and len(ids) == len(whole) + 2


def test_a_long_text_that_cannot_be_cut_is_refused_naming_its_row(tok, small_limits, monkeypatch):
    """A text with no place to cut within MAX_PIECE_CHARS, or of a tokenizer whose texts cannot be
    cut, is refused when longer than MAX_PIECE_CHARS (tokenizing it whole would take memory many
    times its size) with one line naming the row; shorter, it is tokenized whole."""
    from tokenizers import Tokenizer

    import pipeline.tokenize.long_texts as lt

    monkeypatch.setattr(lt, "MAX_PIECE_CHARS", 40)
    fmt = detect_format(["text"], FormatOptions())
    table = pa.table({"text": ["fine", "x" * 41]})
    with pytest.raises(
        UserError,
        match=r"^t.jsonl row 2: the text of 41 characters has no place within 40 "
        r"characters where cutting it.*: split it into rows",
    ) as info:
        tokenize_batch(table, fmt, tok, rows_where("t.jsonl"))
    assert "\n" not in str(info.value)
    spec = json.loads(tok.backend_tokenizer.to_str())
    uncut = Tokenizer.from_str(json.dumps({**spec, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [spec["pre_tokenizer"]]}}))
    assert lt.cut_pattern(uncut) is None
    texts = ["a b " * 9, "word " * 9]  # 36 and 45 chars
    with pytest.raises(
        UserError, match=r"^row 1: the text of 45 characters is longer than the 40 characters this tokenizer encodes at once"
    ):
        lt.encode_bounded(lambda t, c: encode_segments(uncut, t, c), texts, None, lambda: uncut, lambda i: f"row {i}")
    record, calls = _recording(lambda t, c: encode_segments(uncut, t, c))
    got = lt.encode_bounded(record, texts[:1] * 2, None, lambda: uncut, lambda i: f"row {i}")
    assert calls == [texts[:1], texts[:1]]  # whole, one call each (more than CALL_CHARS together)
    assert got[0].tolist() == enc(tok, texts[0]) * 2


def test_cut_places_are_proven_only_for_pipelines_that_keep_them(tok):
    """cut_pattern: None for any part of the pipeline that could join or change text across a cut."""
    from tokenizers import AddedToken, Tokenizer

    from pipeline.tokenize.long_texts import cut_pattern

    spec = json.loads(tok.backend_tokenizer.to_str())
    assert cut_pattern(tok.backend_tokenizer).pattern == r"(?<=[A-Za-z]) (?=[A-Za-z])"
    for change in (
        {"normalizer": {"type": "Lowercase"}},
        {"pre_tokenizer": {**spec["pre_tokenizer"], "use_regex": False}},
        {"model": {**spec["model"], "dropout": 0.1}},
        {"model": {**spec["model"], "end_of_word_suffix": "</w>"}},
    ):
        assert cut_pattern(Tokenizer.from_str(json.dumps({**spec, **change}))) is None, change
    for token in (AddedToken("<sep>", rstrip=True), AddedToken("a b", special=True)):
        backend = Tokenizer.from_str(json.dumps(spec))
        backend.add_tokens([token])
        assert cut_pattern(backend) is None, token
    if LLAMA2.is_dir():  # SentencePiece style: before a space after any char no token puts before "▁"
        llama = load_tokenizer(str(LLAMA2)).backend_tokenizer
        pattern = cut_pattern(llama)
        assert pattern is not None and pattern.search("ab cd").start() == 2 and pattern.search("ab  cd").start() == 2
        assert pattern.search("▁ x") is None

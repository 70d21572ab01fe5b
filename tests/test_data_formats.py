"""Token file formats: round trips, the Megatron .idx byte layout (data/formats.py, and Megatron-LM's
own reader/writer when megatron-core is installed), and every corrupt-input error."""
from __future__ import annotations

import hashlib
import struct
import warnings

import numpy as np
import pytest

from trainbox.data import formats, megatron
from trainbox.data.loader import TokenDataset, open_tokens
from trainbox.data.sources import open_dataset
from trainbox.errors import DataError

DOCS = [np.array(d, dtype=np.uint16) for d in ([5, 6, 7], [9], [], [1, 2, 3, 4, 50000])]


def write_megatron(prefix, docs, dtype=np.uint16):
    w = megatron.MegatronWriter(prefix, dtype, ".partial")
    for d in docs:
        w.add_document(d)
    w.close()
    for tmp, final in w.outputs():
        tmp.rename(final)


def test_shard_round_trip_with_mask(tmp_path):
    toks = np.arange(1000, dtype=np.uint16) * 7
    formats.write_shard(tmp_path / "a.bin", toks)
    assert np.array_equal(formats.read_shard(tmp_path / "a.bin"), toks)
    raw = (tmp_path / "a.bin").read_bytes()
    assert struct.unpack("<3i", raw[:12]) == (20240520, 1, 1000) and len(raw) == 1024 + 2000
    w = formats.ShardWriter(tmp_path / "a.mask", tmp_path / "a.mask.tmp", formats.MASK_MAGIC, np.uint8)
    w.write(np.arange(1000) % 2)
    w.close()
    w.tmp.rename(w.final)
    tokens, mask = open_tokens(tmp_path / "a.bin")
    assert np.array_equal(tokens, toks) and np.array_equal(mask, np.arange(1000) % 2)


def test_flat_round_trip(tmp_path):
    toks = np.array([3, 1, 4, 1, 5, 9, 2, 6], dtype=np.uint16)
    toks.tofile(tmp_path / "train.bin")
    tokens, mask = open_tokens(tmp_path / "train.bin")
    assert np.array_equal(tokens, toks) and mask is None


def test_megatron_idx_bytes_field_by_field(tmp_path):
    """The layout of data/formats.py's docstring, decoded by hand with struct."""
    write_megatron(tmp_path / "d", DOCS)
    raw = (tmp_path / "d.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack_from("<Q", raw, 9) == (1,)
    assert raw[17] == 8  # uint16
    n_seq, n_doc = struct.unpack_from("<QQ", raw, 18)
    assert (n_seq, n_doc) == (4, 5)
    off = 34
    assert list(struct.unpack_from("<4i", raw, off)) == [3, 1, 0, 5]
    assert list(struct.unpack_from("<4q", raw, off + 16)) == [0, 6, 8, 8]  # byte pointers, uint16 = 2 bytes
    assert list(struct.unpack_from("<5q", raw, off + 48)) == [0, 1, 2, 3, 4]
    assert len(raw) == off + 48 + 40
    assert (tmp_path / "d.bin").read_bytes() == np.concatenate(DOCS).astype("<u2").tobytes()
    data = megatron.read_megatron(tmp_path / "d")
    assert data.num_documents == 4 and np.array_equal(data.tokens, np.concatenate(DOCS))
    assert megatron.megatron_dtype(50257) == np.uint16 and megatron.megatron_dtype(65500) == np.int32


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_megatron_matches_megatron_core(tmp_path):
    """Byte-identical to Megatron-LM's own IndexedDatasetBuilder, and readable by its IndexedDataset."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        idx_mod = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    import torch

    for dtype in (np.uint16, np.int32):
        docs = [d.astype(dtype) for d in DOCS] + [np.array([70000, 1], dtype=np.int32).astype(dtype)]
        theirs = idx_mod.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=dtype)
        for d in docs:
            theirs.add_document(torch.from_numpy(d.astype(np.int64)), [len(d)])
        theirs.finalize(str(tmp_path / "m.idx"))
        write_megatron(tmp_path / "o", docs, dtype)
        for ext in ("idx", "bin"):
            assert (tmp_path / f"o.{ext}").read_bytes() == (tmp_path / f"m.{ext}").read_bytes(), (dtype, ext)
        ds = idx_mod.IndexedDataset(str(tmp_path / "o"))
        assert len(ds) == len(docs)
        for i, d in enumerate(docs):
            assert np.array_equal(ds[i], d)


def corrupt(tmp_path, name: str, data: bytes):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def good_shard_bytes(n=10) -> bytes:
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240520, 1, n)
    return header.tobytes() + np.arange(n, dtype=np.uint16).tobytes()


@pytest.mark.parametrize("case, pattern", [
    ("magic", r"x\.bin: bad magic 7 at byte offset 0"),
    ("version", r"x\.bin: unsupported shard version 3 at byte offset 4"),
    ("truncated", r"x\.bin: header says 10 tokens \(1044 bytes\) but the file has 1040 bytes; "
                  r"truncated from byte offset 1040"),
    ("short_header", r"x\.bin: truncated shard header \(100 bytes.*byte offset 100"),
])
def test_corrupt_shard(tmp_path, case, pattern):
    raw = bytearray(good_shard_bytes())
    if case == "magic":
        raw[0:4] = struct.pack("<i", 7)
    elif case == "version":
        raw[4:8] = struct.pack("<i", 3)
    elif case == "truncated":
        raw = raw[:-4]
    else:
        raw = raw[:100]
    p = corrupt(tmp_path, "x.bin", bytes(raw))
    with pytest.raises(DataError, match=pattern):
        formats.read_shard(p)


@pytest.mark.parametrize("case, pattern", [
    ("magic", r"d\.idx: bad magic b'MMIDIDX\\x00X' at byte offset 0"),
    ("version", r"d\.idx: unsupported version 2 at byte offset 9"),
    ("dtype", r"d\.idx: unknown dtype code 42 at byte offset 17"),
    ("idx_truncated", r"d\.idx: 4 sequences and 5 document indices need 122 bytes but the file has 120; truncated "
                      r"from byte offset 120"),
    ("bin_short", r"d\.bin: the index .* describes 9 tokens \(18 bytes\) but the \.bin has 16 bytes; "
                  r"\.idx/\.bin size mismatch from byte offset 16"),
    ("pointer", r"d\.idx: sequence pointer 1 at byte offset 58 is 99, expected 6"),
])
def test_corrupt_megatron(tmp_path, case, pattern):
    write_megatron(tmp_path / "d", DOCS)
    idx, binf = tmp_path / "d.idx", tmp_path / "d.bin"
    raw = bytearray(idx.read_bytes())
    if case == "magic":
        raw[8] = ord("X")
    elif case == "version":
        raw[9:17] = struct.pack("<Q", 2)
    elif case == "dtype":
        raw[17] = 42
    elif case == "idx_truncated":
        raw = raw[:-2]
    elif case == "pointer":
        raw[34 + 16 + 8:34 + 16 + 16] = struct.pack("<q", 99)
    idx.write_bytes(bytes(raw))
    if case == "bin_short":
        binf.write_bytes(binf.read_bytes()[:-2])
    with pytest.raises(DataError, match=pattern):
        megatron.read_megatron(tmp_path / "d")


def test_vocab_and_empty_errors(tmp_path):
    formats.write_shard(tmp_path / "v.bin", np.array([1, 2, 60000, 3], dtype=np.uint16))
    with pytest.raises(DataError,
                       match=r"v\.bin: token id 60000 at token 2 \(byte offset 1028\) is >= the vocab size 50257"):
        open_dataset([tmp_path / "v.bin"], 2, "v", vocab_size=50257)
    write_megatron(tmp_path / "m", [np.array([4, 70], dtype=np.uint16)])
    with pytest.raises(DataError, match=r"m\.bin: token id 70 at token 1 \(byte offset 2\)"):
        open_dataset([tmp_path / "m"], 2, "m", vocab_size=64)
    formats.write_shard(tmp_path / "e.bin", np.zeros(0, dtype=np.uint16))
    with pytest.raises(DataError, match=r"e \(train\): the dataset is empty|the dataset is empty"):
        open_dataset([tmp_path / "e.bin"], 2, "e (train)")
    with pytest.raises(DataError, match=r"odd size 3 .* byte offset 2"):
        formats.read_flat(corrupt(tmp_path, "odd.bin", b"abc"))


def test_readers_never_write_inputs(tmp_path):
    formats.write_shard(tmp_path / "s.bin", np.arange(100, dtype=np.uint16))
    write_megatron(tmp_path / "m", DOCS)
    files = [tmp_path / "s.bin", tmp_path / "m.bin", tmp_path / "m.idx"]
    before = {f: (hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_mtime_ns) for f in files}
    for src in (tmp_path / "s.bin", tmp_path / "m"):
        tokens, _ = open_tokens(src)
        with pytest.raises((ValueError, TypeError)):
            tokens[0] = 1  # read-only memory map
        ds = TokenDataset([tokens], 4)
        ds.batch([0])
    assert before == {f: (hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_mtime_ns) for f in files}


def test_mask_must_match_its_tokens(tmp_path):
    formats.write_shard(tmp_path / "a.bin", np.arange(10, dtype=np.uint16))
    w = formats.ShardWriter(tmp_path / "a.mask", tmp_path / "a.mask.tmp", formats.MASK_MAGIC, np.uint8)
    w.write(np.ones(9))
    w.close()
    w.tmp.rename(w.final)
    with pytest.raises(DataError, match=r"a\.mask: loss mask has 9 entries but .*a\.bin has 10 tokens"):
        open_tokens(tmp_path / "a.bin")
    (tmp_path / "a.mask").write_bytes(good_shard_bytes())  # a token shard where a mask belongs
    with pytest.raises(DataError, match=r"a\.mask: bad magic 20240520 at byte offset 0 .*not a mask file"):
        open_tokens(tmp_path / "a.bin")


def open_for_training(path, fmt="auto", tokenizer="gpt2", vocab=None):
    """The reader path of `trainbox train`: sources.open_datasets with the model's (padded) vocab."""
    from trainbox.config import DataSection
    from trainbox.data.sources import open_datasets
    from trainbox.data.tokenizer import get_tokenizer

    tok = get_tokenizer(tokenizer)
    cfg = DataSection(path=str(path), tokenizer=tokenizer, seq_len=8, format=fmt)
    return open_datasets(cfg, tok, vocab or -(-tok.vocab_size // 64) * 64)


def test_damaged_shard_header_is_never_read_as_flat(tmp_path):
    raw = bytearray(good_shard_bytes(20))
    raw[0:4] = struct.pack("<i", 20240520 ^ 0x100)  # one flipped bit in the magic
    p = corrupt(tmp_path, "x.bin", bytes(raw))
    for fmt in ("auto", "shard"):
        with pytest.raises(DataError, match=rf"{p}: bad magic {20240520 ^ 0x100} at byte offset 0") as e:
            open_for_training(p, fmt)
        assert "data.format" in str(e.value)
    tokens, _ = open_tokens(p, "flat")  # only an explicit data.format=flat reads it as headerless tokens
    assert len(tokens) == len(raw) // 2
    raw[0:4] = struct.pack("<i", 123)  # any magic, when the rest of the 1024 bytes is a shard header
    corrupt(tmp_path, "x.bin", bytes(raw))
    with pytest.raises(DataError, match=rf"{p}: bad magic 123 at byte offset 0"):
        open_for_training(p)


def test_format_setting_is_honoured(tmp_path):
    formats.write_shard(tmp_path / "s.bin", np.arange(100, dtype=np.uint16))
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "f.bin")
    write_megatron(tmp_path / "m", [np.arange(100, dtype=np.uint16)])
    assert len(open_for_training(tmp_path / "s.bin", "shard")[0].arrays[0]) == 100
    assert len(open_for_training(tmp_path / "f.bin", "flat")[0].arrays[0]) == 100
    assert len(open_for_training(tmp_path / "m", "megatron")[0].arrays[0]) == 100
    with pytest.raises(DataError, match=rf"{tmp_path / 'f.bin'}: bad magic .* not a shard file") as e:
        open_for_training(tmp_path / "f.bin", "shard")
    assert "data.format=flat" in e.value.hint
    with pytest.raises(DataError, match=rf"{tmp_path / 's.bin'}: data\.format=flat, but the file starts with the "
                                        r"shard magic at byte offset 0") as e:
        open_for_training(tmp_path / "s.bin", "flat")
    assert "data.format=shard" in e.value.hint
    with pytest.raises(DataError, match=rf"{tmp_path / 'm.bin'}: data\.format=flat, but {tmp_path / 'm.idx'} beside "
                                        r"it makes this the tokens of a Megatron dataset") as e:
        open_for_training(tmp_path / "m.bin", "flat")
    assert "data.format=megatron" in e.value.hint
    with pytest.raises(DataError, match=rf"data\.format=megatron, but {tmp_path / 's.bin'} is not a Megatron dataset"):
        open_for_training(tmp_path / "s.bin", "megatron")


def test_zero_byte_shard_is_an_error(tmp_path):
    formats.write_shard(tmp_path / "x_train_000001.bin", np.arange(100, dtype=np.uint16))
    (tmp_path / "x_train_000002.bin").write_bytes(b"")
    with pytest.raises(DataError, match=rf"{tmp_path / 'x_train_000002.bin'}: empty file \(0 bytes\)"):
        open_for_training(tmp_path / "x")
    with pytest.raises(DataError, match=r"x_train_000002\.bin: empty file \(0 bytes\)"):
        open_for_training(tmp_path / "x", "shard")


def test_vocab_is_the_tokenizers_not_the_padded_model_vocab(tmp_path):
    toks = np.arange(40, dtype=np.uint16)
    toks[25] = 50300  # < 50,304 (the model's padded vocab) but >= GPT-2's 50,257
    formats.write_shard(tmp_path / "v.bin", toks)
    with pytest.raises(DataError, match=rf"{tmp_path / 'v.bin'}: token id 50300 at token 25 \(byte offset 1074\) "
                                        r"is >= the vocab size 50257") as e:
        open_for_training(tmp_path / "v.bin", vocab=50304)
    assert "gpt2" in e.value.hint


def test_megatron_document_indices_are_checked(tmp_path):
    write_megatron(tmp_path / "d", DOCS)
    idx = tmp_path / "d.idx"
    raw = bytearray(idx.read_bytes())
    raw[-8:] = struct.pack("<q", 9)  # the last document index must be the sequence count (4)
    idx.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=rf"{idx}: document index 4 at byte offset {len(raw) - 8} is 9"):
        megatron.read_megatron(tmp_path / "d")


def test_text_is_never_read_as_headerless_tokens(tmp_path):
    """A file with no header and no text suffix is read as flat uint16 tokens only when its first bytes are not
    printable UTF-8 text: a checkpoint's `latest` pointer, a YAML file, or text whose first 1,024 bytes end inside a
    two-byte character are refused under data.format=auto, and read as data.format=flat asks; GPT-2 tokens of
    text, written headerless, still read as flat."""
    from trainbox.data.tokenizer import get_tokenizer

    ids = np.array(get_tokenizer("gpt2").encode("To be, or not to be, that is the question.\n" * 40), np.uint16)
    ids.tofile(tmp_path / "tokens")
    assert formats.detect_format(tmp_path / "tokens") == "flat"
    assert open_tokens(tmp_path / "tokens")[0].tolist() == ids.tolist()
    texts = {"latest": b"step_00000030\n", "config.yaml": b"run:\n  name: x\n  seed: 12\n",
             "cut": b"a" + "\u00e9".encode() * 600 + b"\n"}   # the 1,024th byte starts a two-byte character
    for name, raw in texts.items():
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(DataError, match=rf"{tmp_path / name}: its first {min(len(raw), 1024):,} bytes are text "
                                            r"\(printable UTF-8\), not headerless uint16 tokens") as e:
            open_for_training(tmp_path / name)
        assert "data.format=flat" in e.value.hint and "trainbox prepare" in e.value.hint
        assert len(open_tokens(tmp_path / name, "flat")[0]) == len(raw) // 2


def test_a_folder_of_token_files_that_are_not_shards_names_them_and_a_dataset_to_give(tmp_path):
    """A folder with .bin files is read as a folder of shards (PREFIX_train_*.bin); when none is named so, the
    message lists its .bin files and the hint names one dataset as data.path takes it (a Megatron dataset by its
    prefix), instead of a search for FOLDER_train_*.bin."""
    (tmp_path / "mix").mkdir()
    (tmp_path / "mix" / "notes.txt").write_text("text beside the tokens\n")
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "mix" / "b.bin")
    (tmp_path / "meg").mkdir()
    write_megatron(tmp_path / "meg" / "corpus_text_document", [np.arange(100, dtype=np.uint16)])
    for folder, names, first in (("mix", "b.bin", "mix/b.bin"),
                                 ("meg", "corpus_text_document.bin", "meg/corpus_text_document")):
        with pytest.raises(DataError, match=rf"data\.path={tmp_path / folder} is a folder of \.bin files, none of "
                                            rf"them a shard named PREFIX_train_\*\.bin, .* \({names}\)\n") as e:
            open_for_training(tmp_path / folder)
        assert e.value.hint.startswith(f"name one dataset, e.g. data.path={tmp_path / first};")
        assert len(open_for_training(tmp_path / first)[0].arrays[0]) == 100   # the dataset the hint names

"""python -m project.cli.prepare: corpora into token shards, checked by decoding the shards back to the documents."""

import csv
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, PreloadedRun, isolated_env, kill_process_tree, require_extra, resize, train
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

import project.cli.prepare
from project.checkpointing.files import META_FILE
from project.cli.prepare import bpe_pre_tokenizer, input_files, is_validation, pieces, prepare
from project.data.sampling import EpochShuffle, GlobalBatchSampler
from project.data.shards import HEADER_BYTES, ShardsDataModule, read_shard
from project.options.errors import ConfigError

STDLIB_JSON = Path(json.__file__).parent  # a corpus that ships with Python: the json package's sources


def split_tokens(out: Path, split: str) -> np.ndarray:
    meta = json.loads((out / "meta.json").read_text())
    return np.concatenate([read_shard(out / shard["file"]) for shard in meta["splits"][split]["shards"]])


def decoded_documents(tokens: np.ndarray, tokenizer: Tokenizer, separator: int) -> list[str]:
    """The texts between separators, decoded by the tokenizer."""
    ends = np.flatnonzero(tokens == separator)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(tokens[start:end].tolist()) for start, end in zip(starts, ends)]


@pytest.fixture
def corpus(tmp_path) -> Path:
    """The json package's sources, and a .jsonl file of documents."""
    root = tmp_path / "corpus"
    (root / "json").mkdir(parents=True)
    for source in STDLIB_JSON.glob("*.py"):
        (root / "json" / source.name).write_text(source.read_text())
    lines = [json.dumps({"text": f"Document {i}: " + "naïve café, 東京 " * (i % 7)}) for i in range(300)]
    (root / "notes.jsonl").write_text("\n".join(lines) + "\n")
    (root / "json" / "__pycache__").mkdir()  # as in an installed package: byte code, not text
    (root / "json" / "__pycache__" / "decoder.cpython-311.pyc").write_bytes(bytes(range(256)))
    (root / ".notes.jsonl.swp").write_bytes(b"an editor's swap file")
    return root


def test_a_trained_byte_level_bpe_gives_back_every_document(corpus, tmp_path):
    out = tmp_path / "out"
    meta = prepare([corpus], out, vocab_size=600, shard_tokens=3000, val_fraction=0.05)
    assert meta["vocab_size"] == 600 and meta["dtype"] == "uint16" and meta["separator"]["token"] == "<|endoftext|>"
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    files = input_files([corpus])
    assert [path.name for path in files] == [*sorted(p.name for p in STDLIB_JSON.glob("*.py")), "notes.jsonl"]
    read = list(pieces(files, "text", bpe_pre_tokenizer()))
    assert all(last for _, last in read)  # no document longer than a piece: each whole, as it is in its file
    texts = [text for text, _ in read]
    for split in ("train", "val"):
        shards = meta["splits"][split]["shards"]
        assert all(shard["tokens"] == 3000 for shard in shards[:-1]) and 0 < shards[-1]["tokens"] <= 3000
        tokens = split_tokens(out, split)
        assert len(tokens) == meta["splits"][split]["tokens"]
        expected = [text for index, text in enumerate(texts) if is_validation(index, 0.05) == (split == "val")]
        assert decoded_documents(tokens, tokenizer, meta["separator"]["id"]) == expected  # byte-level: exact
    assert len(meta["splits"]["val"]["shards"]) >= 1 and len(meta["splits"]["train"]["shards"]) > 5
    first = out / meta["splits"]["train"]["shards"][0]["file"]
    header = np.fromfile(first, dtype="<i4", count=4)
    assert header[2] == 3000 and header[3] == 2 and first.stat().st_size == HEADER_BYTES + 3000 * 2
    first.write_bytes(b"\0" * 8 + first.read_bytes()[8:])  # a damaged header is refused
    with pytest.raises(ValueError, match="not a token shard"):
        read_shard(first)


# Llama 3's pre-tokenizer pattern (its tokenizer.json): numbers in threes, a newline run with the spaces before it,
# and a run of spaces before a word giving the word its last one (a boundary that depends on what follows).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def llama3_like_tokenizer(texts: list[str], path: Path) -> Path:
    """A byte-level BPE with Llama 3's pre-tokenizer, trained on ``texts``, saved as a tokenizer.json."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"), pre_tokenizers.ByteLevel(use_regex=False)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|end_of_text|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(path))
    return path


def documents_of(sizes: list[int]) -> list[str]:
    """Documents of about ``sizes`` characters: Python's json sources again and again (indentation, blank lines,
    numbers, runs of spaces), each starting at another file."""
    sources = [path.read_text() for path in sorted(STDLIB_JSON.glob("*.py"))]
    documents = []
    for number, size in enumerate(sizes):
        text, index = "", number
        while len(text) < size:
            text += sources[index % len(sources)] + f"\n\n# {number} {size}   spaces\t\t\n"
            index += 1
        documents.append(text[:size])
    return documents


def assert_each_document_tokenized_whole(out: Path, documents: list[str], val_fraction: float) -> None:
    """Each split holds its documents, and no other, each as the tokenizer encodes it whole, then the separator."""
    meta = json.loads((out / "meta.json").read_text())
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    for split in ("train", "val"):
        tokens = split_tokens(out, split)
        ends = np.flatnonzero(tokens == meta["separator"]["id"])
        got = [tokens[start:end].tolist() for start, end in zip(np.concatenate([[0], ends[:-1] + 1]), ends)]
        expected = [
            tokenizer.encode(text, add_special_tokens=False).ids
            for index, text in enumerate(documents)
            if is_validation(index, val_fraction) == (split == "val")
        ]
        assert len(got) == len(expected) > 0, split
        for index, (ours, theirs) in enumerate(zip(got, expected)):
            assert ours == theirs, f"{split} document {index}: tokens differ from the tokenizer's"


@pytest.mark.parametrize("tokenizer", ["trained", "llama3_like"])
def test_a_long_document_is_cut_where_the_tokenizer_has_a_boundary_and_kept_in_one_split(
    tokenizer, tmp_path, monkeypatch
):
    """Documents of 1 to 60 pieces (pieces of 500 characters here), as a .jsonl and as one long line: each
    piece is cut where the tokenizer's pre-tokenizer begins a word, so the prepared tokens equal the tokenizer's
    encoding of the whole document, and each document goes to one split, all of it."""
    monkeypatch.setattr(project.cli.prepare, "PIECE_CHARS", 500)
    monkeypatch.setattr(project.cli.prepare, "LOOKAHEAD_CHARS", 100)
    documents = documents_of([300, 2_000, 8_000, 30_000] * 3)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    given = None if tokenizer == "trained" else llama3_like_tokenizer(documents[:2], tmp_path / "tokenizer.json")
    read = list(pieces([tmp_path / "docs.jsonl"], "text", bpe_pre_tokenizer()))
    assert sum(last for _, last in read) == len(documents) and len(read) > 150 and all(len(p) <= 500 for p, _ in read)
    out = tmp_path / "out"
    prepare([tmp_path / "docs.jsonl"], out, tokenizer_path=given, vocab_size=400, shard_tokens=5000, val_fraction=0.3)
    assert_each_document_tokenized_whole(out, documents, 0.3)


@pytest.mark.slow
def test_documents_of_10_kb_to_5_mb_are_prepared_as_the_tokenizer_encodes_them(tmp_path):
    """At the real piece size (64 Ki characters), a corpus of documents of 10 KB to 5 MB (text files, read a
    piece at a time) through Llama 3's pre-tokenizer: every document's tokens are the tokenizer's."""
    documents = documents_of([10_000, 200_000, 1_000_000, 5_000_000, 50_000, 10_000])
    for index, text in enumerate(documents):
        (tmp_path / f"doc{index}.txt").write_text(text)
    given = llama3_like_tokenizer(documents[:1], tmp_path / "tokenizer.json")
    out = tmp_path / "out"
    files = [tmp_path / f"doc{index}.txt" for index in range(len(documents))]
    prepare(files, out, tokenizer_path=given, shard_tokens=500_000, val_fraction=0.3)
    assert_each_document_tokenized_whole(out, documents, 0.3)


def test_a_given_tokenizer_with_a_large_vocabulary_writes_uint32(tmp_path):
    """A tokenizer.json by path (here a word-level one of 70,000 words, past uint16's range)."""
    words = [f"w{i}" for i in range(70_000)]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(["</s>", "<unk>", *words])}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    rng = np.random.default_rng(0)
    documents_text = [" ".join(rng.choice(words, size=20)) for _ in range(50)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": text}) + "\n" for text in documents_text))
    out = tmp_path / "out"
    meta = prepare(
        [tmp_path / "docs.jsonl"],
        out,
        tokenizer_path=tmp_path / "tokenizer.json",
        text_key="body",
        shard_tokens=400,
        val_fraction=0.0,
    )
    assert (
        meta["vocab_size"] == 70_002 and meta["dtype"] == "uint32" and meta["separator"] == {"token": "</s>", "id": 0}
    )
    tokens = split_tokens(out, "train")
    assert tokens.dtype == np.dtype("<u4") and tokens.max() > 2**16
    assert len(tokens) == 50 * 21 and meta["splits"]["val"]["tokens"] == 0
    assert decoded_documents(tokens, tokenizer, 0) == documents_text


def recorded_shards(out: Path) -> list[str]:
    """The shards an interrupted prepare records as finished in its progress.json (replaced whole, never
    half-written)."""
    progress = out / "progress.json"
    if not progress.is_file():
        return []
    splits = json.loads(progress.read_text())["splits"].values()
    return [shard["file"] for split in splits for shard in split["shards"]]


@pytest.mark.slow
def test_an_interrupted_prepare_continues_without_redoing_finished_shards(corpus, tmp_path):
    """SIGKILL after some shards, the same command again: the shards of an uninterrupted run, byte for byte, and
    the finished ones untouched."""
    for copy in range(12):  # a corpus long enough to be killed halfway
        (corpus / f"copy{copy}.jsonl").write_text(
            (corpus / "notes.jsonl").read_text().replace("Document", f"Copy {copy}")
        )
    args = [str(corpus), "--vocab-size", "600", "--shard-tokens", "2000", "--val-fraction", "0.05"]
    straight = tmp_path / "straight"
    prepare([corpus], straight, vocab_size=600, shard_tokens=2000, val_fraction=0.05)
    out = tmp_path / "interrupted"
    command = [sys.executable, "-m", "project.cli.prepare", *args, "--out", str(out)]
    job = subprocess.Popen(
        command, cwd=REPO, env=isolated_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    while len(recorded_shards(out)) < 4:
        assert job.poll() is None, "prepare ended before it could be interrupted"
        time.sleep(0.005)
    job.send_signal(signal.SIGKILL)
    job.wait()
    # Finished: the shards progress.json records. A shard written but not yet recorded when the kill came is
    # written again, whole.
    finished = {name: (out / name).stat().st_mtime_ns for name in recorded_shards(out)}
    assert len(finished) >= 4 and not (out / "meta.json").exists()
    rerun = subprocess.run(command, cwd=REPO, env=isolated_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert all((out / name).stat().st_mtime_ns == mtime for name, mtime in finished.items())
    assert sorted(path.name for path in out.glob("*.bin")) == sorted(path.name for path in straight.glob("*.bin"))
    for path in straight.glob("*.bin"):
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name
    assert json.loads((out / "meta.json").read_text()) == json.loads((straight / "meta.json").read_text())


def test_a_full_disk_stops_prepare_with_the_path_and_a_rerun_with_space_finishes_it(corpus, tmp_path, small_disk):
    """--out on a 64 KiB file system: prepare ends with the documented message naming the shard it could not write,
    exit code 1 and no traceback, and leaves no partial file; with the disk grown, the same command finishes the
    shards an uninterrupted run writes, byte for byte."""
    for copy in range(12):
        (corpus / f"copy{copy}.jsonl").write_text(
            (corpus / "notes.jsonl").read_text().replace("Document", f"Copy {copy}")
        )
    straight = tmp_path / "straight"
    prepare([corpus], straight, vocab_size=600, shard_tokens=2000, val_fraction=0.05)
    disk = small_disk("64k")
    out = disk / "out"
    command = [sys.executable, "-m", "project.cli.prepare", str(corpus), "--vocab-size", "600", "--shard-tokens"]
    command += ["2000", "--val-fraction", "0.05", "--out", str(out)]
    full = subprocess.run(command, cwd=REPO, env=isolated_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
    message = re.search(
        r"Could not write (token shard|progress file|tokenizer) (\S+): No space left on device", full.stderr
    )
    assert message and Path(message.group(2)).parent == out, full.stderr
    assert "Free space on that disk (or make --out writable), then run the same command again" in full.stderr
    assert not list(out.glob("*.partial"))
    resize(disk, "16m")
    rerun = subprocess.run(command, cwd=REPO, env=isolated_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(path.name for path in out.glob("*.bin")) == sorted(path.name for path in straight.glob("*.bin"))
    for path in straight.glob("*.bin"):
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name


def test_shard_windows_are_the_token_stream_across_shard_ends_and_batch_alike_on_any_device_count(corpus, tmp_path):
    """data=shards' windows, read through memory maps, against the whole split concatenated in memory; and the
    global batches of one replica equal the two replicas' batches side by side."""
    out = tmp_path / "out"
    prepare([corpus], out, vocab_size=600, shard_tokens=1000, val_fraction=0.05)
    data = ShardsDataModule(str(out), seq_length=64, batch_size=8, seed=3)
    data.setup("fit")
    stream = torch.from_numpy(split_tokens(out, "train").astype(np.int64))
    assert len(data.train_set) == (len(stream) - 1) // 64 == data.num_train_samples
    # Every window in one batch read, in a shuffled order; many straddle a shard's end (1000 is not a multiple of 64).
    indices = torch.randperm(len(data.train_set), generator=torch.Generator().manual_seed(0)).tolist()
    inputs, targets = data.train_set[indices]
    for row, index in enumerate(indices):
        assert torch.equal(inputs[row], stream[index * 64 : index * 64 + 64])
        assert torch.equal(targets[row], stream[index * 64 + 1 : index * 64 + 65])
    order = EpochShuffle(len(data.train_set), shuffle=True, seed=3)
    one = [batch.tolist() for batch in GlobalBatchSampler(order, 16, rank=0, world_size=1, drop_last=True)]
    two = [
        [batch.tolist() for batch in GlobalBatchSampler(order, 8, rank=rank, world_size=2, drop_last=True)]
        for rank in (0, 1)
    ]
    assert one == [left + right for left, right in zip(*two)]
    with pytest.raises(ConfigError, match="data.path: .* has no meta.json"):
        ShardsDataModule(str(tmp_path), seq_length=64, batch_size=8, seed=3)


def csv_rows(job_dir: Path, version: int) -> list[dict[str, float]]:
    """The rows of a job's CSV log (``logger=csv``), the empty cells left out."""
    with open(job_dir / "csv" / f"version_{version}" / "metrics.csv") as file:
        return [{key: float(value) for key, value in row.items() if value != ""} for row in csv.DictReader(file)]


def by_step(rows: list[dict[str, float]], key: str) -> dict[int, float]:
    return {int(row["step"]): row[key] for row in rows if key in row}


def saved_checkpoint(last: Path) -> dict | None:
    """The checkpoint ``last`` holds (its metadata where it is a sharded dir), None while there is none: a background
    write swaps the new dir in for the old one by renaming, so that the path is briefly absent (or a dir where it
    was looked for as a file)."""
    try:
        return torch.load(last / META_FILE if last.is_dir() else last, weights_only=False)
    except (FileNotFoundError, IsADirectoryError):
        return None


@pytest.mark.slow
def test_training_on_shards_resumes_exactly_after_a_sigkill_mid_epoch_on_one_device_and_on_fsdp_x_2(corpus, tmp_path):
    """The tiny GPT on the prepared corpus, 12 batches an epoch, validated every 6 batches, a checkpoint every 5
    steps (and after each validation) and a step row every step. fsdp x 2 (8 per device, a DataLoader worker each, so
    the workers open their own memory maps; fsdp restores the checkpoint after its optimizer, and so the LR
    schedule's length and the training loader, are set up) run whole; fsdp and auto (16 sequences a batch) each have
    their process tree killed with SIGKILL at step 17 (two steps after the step-15 checkpoint, in the middle of
    epoch 1, before its validation at step 18), then resume with ckpt_path=last. Before and after the kill they log
    the whole run's step losses, validations and epoch-1 numbers: fsdp to 1e-6, auto to 1e-5."""
    out = tmp_path / "prepared"
    prepare([corpus], out, vocab_size=300, shard_tokens=5000, val_fraction=0.05)
    common = [
        "model=gpt",
        "data=shards",
        f"data.path={out}",
        "data.seq_length=32",
        "model.net.dim=32",
        "model.net.num_heads=2",
        "trainer.max_epochs=2",
        "+trainer.limit_train_batches=12",
        "trainer.val_check_interval=6",
        "trainer.log_every_n_steps=1",
        "callbacks.model_checkpoint.every_n_train_steps=5",
        "logger=csv",
        "print_config=false",
        "~callbacks.progress_bar",
        "+trainer.enable_progress_bar=false",
    ]
    runs = {
        "fsdp": ["strategy=fsdp", "trainer.devices=2", "data.batch_size=8", "data.num_workers=1"],
        "auto": ["data.batch_size=16"],
    }
    # fsdp's whole run is the expected numbers of both: fsdp's own resume to 1e-6, auto's (another code path to
    # the same global batches) to 1e-5.
    train([*common, *runs["fsdp"], f"hydra.run.dir={tmp_path / 'whole'}"], tmp_path / "home")
    whole = csv_rows(tmp_path / "whole", 0)
    assert [row["step"] for row in whole] == sorted(row["step"] for row in whole)  # rows in order
    # Its export carries the corpus's tokenizer: transformers' AutoTokenizer reads it back and encodes alike.
    exported = tmp_path / "exported"
    checkpoint = tmp_path / "whole" / "checkpoints" / "last.ckpt"
    command = [sys.executable, "-m", "project.cli.export", str(checkpoint), str(exported)]
    done = subprocess.run(command, cwd=REPO, env=isolated_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "tokenizer.json, tokenizer_config.json" in done.stdout, done.stderr
    tokenizer = require_extra("transformers", "dev").AutoTokenizer.from_pretrained(exported)
    prepared = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "def main(argv):\n    return json.dumps({'naïve': 1})"
    assert len(tokenizer) == prepared.get_vocab_size() == 300
    assert tokenizer.encode(text, add_special_tokens=False) == prepared.encode(text, add_special_tokens=False).ids
    assert tokenizer.eos_token == json.loads((out / "meta.json").read_text())["separator"]["token"]
    for name, args in runs.items():
        tolerance = 1e-6 if name == "fsdp" else 1e-5
        job = tmp_path / f"{name}-killed"
        marker = tmp_path / f"{name}-at-step-17"
        run = PreloadedRun(
            [
                *common,
                *args,
                f"hydra.run.dir={job}",
                "+callbacks.stall._target_=helpers.probes.StallAtStep",
                "+callbacks.stall.step=17",
                f"+callbacks.stall.marker={marker}",
            ],
            tmp_path / "home",
        )
        launched = time.monotonic()
        while not marker.exists():
            if run.poll() is not None:
                pytest.fail(f"{name}: exited {run.returncode} before step 17:\n{run.communicate()[0][-6000:]}")
            if time.monotonic() - launched > 300:
                kill_process_tree(run.pid)
                pytest.fail(f"{name}: no step 17 after 300 s; its console:\n{run.communicate()[0][-6000:]}")
            time.sleep(0.05)
        last = job / "checkpoints" / "last.ckpt"
        # fsdp writes its checkpoints in the background (async_save): on a busy machine the step-15 one can still be
        # on its way at step 17 (CI once killed the run with last.ckpt at step 12). The kill waits for it.
        while (saved := saved_checkpoint(last)) is None or saved["global_step"] < 15:
            if time.monotonic() - launched > 420:
                kill_process_tree(run.pid)
                pytest.fail(f"{name}: no step-15 checkpoint after 420 s: {saved and saved['global_step']}")
            time.sleep(0.05)
        kill_process_tree(run.pid)  # the launcher and every rank at once, as a node failure would
        assert run.wait(timeout=60) == -signal.SIGKILL
        checkpoint = saved_checkpoint(last)
        assert checkpoint is not None and (checkpoint["global_step"], checkpoint["epoch"]) == (15, 1)
        assert checkpoint["ShardsDataModule"] == {"epoch": 1, "batches": 3}  # where the data stood: 3 of epoch 1's 12
        started = time.monotonic()
        train([*common, *args, f"hydra.run.dir={job}", "ckpt_path=last"], tmp_path / "home")
        resumed_for = time.monotonic() - started
        before, after = csv_rows(job, 0), csv_rows(job, 1)
        for key, steps in (("step/train_loss", range(16, 25)), ("val/loss", (18, 24))):
            expected, got = by_step(whole, key), by_step(after, key)
            assert sorted(got) == list(steps), key
            for step in steps:
                assert got[step] == pytest.approx(expected[step], rel=tolerance, abs=0), (name, key, step)
        killed = by_step(before, "step/train_loss")
        # The run up to its kill: the whole run's first steps (those its CSV logger had flushed).
        assert sorted(killed) == list(range(1, len(killed) + 1)) and len(killed) >= 6
        assert all(
            killed[step] == pytest.approx(by_step(whole, "step/train_loss")[step], rel=tolerance) for step in killed
        )
        last_epoch = [row for row in after if "train/loss" in row]
        assert len(last_epoch) == 1 and last_epoch[0]["epoch"] == 1
        assert 0 < last_epoch[0]["perf/epoch_time_s"] < resumed_for  # the part of epoch 1 the resumed run ran
        expected_epoch = [row for row in whole if "train/loss" in row][1]
        assert last_epoch[0]["train/loss"] == pytest.approx(expected_epoch["train/loss"], rel=tolerance, abs=0)


def test_binary_files_in_an_input_dir_are_left_out_and_named(corpus, capsys):
    """An executable and random bytes beside the corpus's text are not tokenized as documents: left out, and said."""
    (corpus / "json" / "python.bin").write_bytes(Path(sys.executable).resolve().read_bytes()[:100_000])
    (corpus / "noise.dat").write_bytes(bytes(range(256)) * 10)
    files = input_files([corpus])
    assert not {corpus / "json" / "python.bin", corpus / "noise.dat"} & set(files)
    assert corpus / "notes.jsonl" in files and all(path.suffix in (".py", ".jsonl") for path in files)
    assert "Left out 2 binary file(s), not UTF-8 text:" in capsys.readouterr().err

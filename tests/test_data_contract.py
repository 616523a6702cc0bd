"""The data-module contract (``project.data.datamodule.DataModule``) holds for every data option's real batches: the
shape a module declares, which the memory plan feeds its simulated step, is that of the batches it makes; and
``every_sample``, what a task's precomputation runs over, hands each sample to exactly one replica, in as many
batches on each, its rows those of the samples it names (a preference pair's, by the index column too)."""

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from test_config import compose_train

from project.cli.chat_example import write_example
from project.data.datamodule import DataModule, split_index_column

OPTIONS = ["synthetic", "tokens", "text", "chat", "preference"]


@pytest.fixture(scope="module")
def example_dir(tmp_path_factory) -> Path:
    """The chat example's tiny model dir and records, and a text file."""
    out = tmp_path_factory.mktemp("data-contract")
    write_example(out, count=16)
    (out / "story.txt").write_text("Once upon a time there was a tiny model that read bytes. " * 20)
    return out


def data_module(option: str, example_dir: Path) -> DataModule:
    """``data=option`` as a user composes it, small, set up."""
    overrides = {
        "synthetic": [],
        "tokens": ["model=gpt", "data=tokens", "data.seq_length=16"],
        "text": ["model=gpt", "data=text", f"data.path={example_dir / 'story.txt'}", "data.seq_length=16"],
        "chat": ["model=qwen3", "data=chat", f"data.path={example_dir / 'hello.jsonl'}"],
        "preference": ["model=qwen3", "experiment=dpo", f"data.path={example_dir / 'preference.jsonl'}"],
    }[option]
    templated = (
        [f"data.tokenizer={example_dir / 'model'}", "data.seq_length=48"] if option in ("chat", "preference") else []
    )
    data = instantiate(compose_train([*overrides, *templated]).data)
    data.setup("fit")
    return data


@pytest.mark.parametrize("option", OPTIONS)
def test_the_declared_shape_is_a_real_batchs(option, example_dir):
    data = data_module(option, example_dir)
    real = data.samples_at([0, 1, 2])
    example = data.shape.example_batch(3)
    assert [(tensor.shape, tensor.dtype) for tensor in example] == [(tensor.shape, tensor.dtype) for tensor in real]


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("replicas", [1, 3])
def test_every_sample_goes_to_one_replica_in_as_many_batches_on_each(option, replicas, example_dir):
    data = data_module(option, example_dir)
    count = data.num_train_samples + data.num_val_samples
    shares = [list(data.every_sample(rank, replicas)) for rank in range(replicas)]
    assert len({len(share) for share in shares}) == 1  # as many batches on every replica
    indices = torch.cat([samples for share in shares for samples, _ in share])
    assert sorted(indices.tolist()) == list(range(count))  # each sample once
    train, val = data.train_set, data.val_set
    assert train is not None and val is not None
    for share in shares:
        for samples, (inputs, target) in share:
            assert 0 < len(samples) <= data.batch_size
            assert len(inputs) == len(target) == len(samples) * data.sequences_per_sample
            first = samples[0].item()  # the rows are those of the samples named, by the splits' own indexing
            dataset, at = (train, first) if first < data.num_train_samples else (val, first - data.num_train_samples)
            assert torch.equal(inputs[: data.sequences_per_sample], dataset[[at]][0])
            if data.index_column:  # each row names its sample: what keys a precomputation's values
                assert torch.equal(split_index_column(target)[1], samples.repeat_interleave(data.sequences_per_sample))

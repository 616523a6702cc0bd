"""A sample of the text a language model writes, after each validation."""

from typing import TYPE_CHECKING, Any, cast

import lightning as L
from omegaconf import DictConfig, OmegaConf

from project.data.datamodule import trainer_data
from project.models.generation import generate
from project.observability.loggers import EpochWandbLogger
from project.options.config_rules import ConfigRules, RunData
from project.options.errors import ConfigError
from project.options.option_types import NonNegativeFloat, PositiveInt, Seed

if TYPE_CHECKING:
    from project.tasks.base import TrainingModule


class TextSample(L.Callback, ConfigRules):
    """After each validation (not the sanity check), ``max_new_tokens`` tokens the model writes after ``prompt``
    (``project.models.generation.generate``: ``temperature``, ``top_k``, ``seed``), printed and kept in the W&B run's
    table ``samples`` (epoch, step, prompt, text: one row per validation). ``prompt`` null: no sample.

    Every rank generates (an FSDP forward needs them all), drawing the same tokens; rank 0 prints and logs. The
    context is cut to the data's sequence length, the longest the model trained on.
    """

    def __init__(
        self,
        prompt: str | None,
        max_new_tokens: PositiveInt = 64,
        temperature: NonNegativeFloat = 0.8,  # 0: always the most likely token
        top_k: PositiveInt | None = 50,  # None: draw among every token
        seed: Seed = 0,
    ) -> None:
        self.prompt, self.max_new_tokens, self.temperature, self.top_k, self.seed = (
            prompt,
            max_new_tokens,
            temperature,
            top_k,
            seed,
        )
        self.rows: list[dict[str, Any]] = []

    @staticmethod
    def check_run_config(cfg: DictConfig, node: str, data: RunData) -> None:
        """A prompt (``callbacks.<name>.prompt``) needs text data. (And ranks that each run the whole model: a rule
        on the job, ``project.job.rules.layout_problem``.)"""
        key = f"{node}.prompt"
        prompt = OmegaConf.select(cfg, key)
        if prompt is None:
            return
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError(key, f"is {prompt!r}.", f"give the text to continue, e.g. {key}='Once upon a time'.")
        if data.text_codec() is None:
            raise ConfigError(
                key,
                f"is set, but {type(data).__name__} has no text to write a prompt in.",
                f"use data=text or data=shards, or {key}=null.",
            )

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.prompt is None or trainer.sanity_checking:
            return
        data = trainer_data(trainer)
        codec, net = data.text_codec(), cast("TrainingModule", pl_module).net
        assert codec is not None  # checked before launch (check_run_config)
        training = net.training
        net.eval()
        tokens = generate(
            net,
            codec.encode(self.prompt),
            self.max_new_tokens,
            self.temperature,
            self.top_k,
            self.seed,
            max_length=data.seq_length,
        )
        net.train(training)
        text = codec.decode(tokens)
        self.rows.append(
            {"epoch": trainer.current_epoch, "step": trainer.global_step, "prompt": self.prompt, "text": text}
        )
        if trainer.is_global_zero:
            print(f"Sample (epoch {trainer.current_epoch}, step {trainer.global_step}): {self.prompt}{text}")
            for logger in trainer.loggers:
                if isinstance(logger, EpochWandbLogger):
                    logger.log_summary_table("samples", self.rows)

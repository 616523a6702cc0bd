"""python -m project.cli.generate <checkpoint> --prompt TEXT: the text a trained language model writes after a prompt.

The model and the data's tokenizer come from the job's ``config.yaml`` (beside ``checkpoints/``, or ``--config``);
the checkpoint is a file or a sharded dir, read into one process (``project.cli.usage.merged_model_state``): a LoRA
run's base rebuilt as the run built it, its adapters merged into the weights they adapt. The same weights, prompt and
settings write the text the ``text_sample`` callback writes during training. With ``--chat`` (a data=chat or
data=preference run), the prompt is a user's message, rendered with the data's chat template and its generation
prompt, and the answer ends at the template's end of an assistant turn (``<|im_end|>``, ``<|eot_id|>``...).
"""

import argparse

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from project.cli.usage import checkpoint_and_config, merged_model_state, run_cli
from project.data.templated import TemplatedDataModule
from project.models.generation import check_settings, generate
from project.options.errors import ConfigError


def innermost(error: BaseException) -> str:
    """The first cause of ``error`` (Hydra wraps a constructor's error in its own), as one line."""
    while error.__cause__ is not None:
        error = error.__cause__
    return str(error).splitlines()[0].rstrip(".") + "."


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m project.cli.generate", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint file or sharded checkpoint dir (checkpoints/last.ckpt)")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to write (default 64)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: always the most likely token (default 0.8)")
    parser.add_argument(
        "--top-k", type=int, default=50, help="draw among the k most likely tokens; 0: all (default 50)"
    )
    parser.add_argument("--seed", type=int, default=None, help="the draws' seed (default: the job's seed)")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user's message, in the chat template (data=chat and data=preference runs)",
    )
    parser.add_argument("--config", help="the job's config.yaml (default: beside the checkpoints dir)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where to run")
    args = parser.parse_args(argv)
    problem = check_settings(args.max_new_tokens, args.temperature, args.top_k or None)
    if problem is not None:
        setting, text = problem.split(": ", 1)
        parser.error(f"--{setting.replace('_', '-')}: {text}")
    if not args.prompt:
        parser.error("--prompt is empty: give the text to continue")
    cfg = checkpoint_and_config(args.checkpoint, args.config)
    try:
        data = instantiate(cfg.data)
        codec = data.text_codec()
    except (InstantiationException, ConfigError, OSError) as error:  # the data moved since the job ran
        raise ConfigError(
            "--config",
            f"names data that cannot be opened now ({cfg.data._target_}): {innermost(error)}",
            "pass a --config whose data.path is where the job's data is now (a copy of its config.yaml, edited).",
        ) from None
    if args.chat and not isinstance(data, TemplatedDataModule):
        raise ConfigError(
            "--chat", f"needs a data=chat or data=preference run; this one's data is {cfg.data._target_}.", "drop it."
        )
    if codec is None:
        raise ConfigError(
            "checkpoint",
            f"is of a job whose data ({cfg.data._target_}) is not text: there is no prompt to write.",
            "generate from a checkpoint of a language model trained on data=text, shards, chat or preference.",
        )
    prompt, stop = args.prompt, None
    if args.chat:
        template = data.renderer.template
        prompt = template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
        stop = template.end_of_turn(data.renderer.tokenizer)
    state = merged_model_state(args.checkpoint, cfg)
    with torch.device("meta"):
        net = instantiate(cfg.model.net)
    try:
        net.load_state_dict(state, assign=True)  # tensors as saved, in place of the meta ones
    except RuntimeError as error:
        raise ConfigError(
            "checkpoint",
            f"does not fit the config's model: {str(error).splitlines()[0]}",
            "pass the --config of the job that saved the checkpoint.",
        ) from None
    net.to(args.device).eval()
    tokens = generate(
        net,
        codec.encode(prompt),
        args.max_new_tokens,
        args.temperature,
        args.top_k or None,
        cfg.seed if args.seed is None else args.seed,
        max_length=cfg.data.seq_length,
        stop=stop,
    )
    print(prompt + codec.decode(tokens))


if __name__ == "__main__":
    run_cli("python -m project.cli.generate", main)

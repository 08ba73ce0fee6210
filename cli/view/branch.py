"""The `decodelab sample` command line that reruns a trace's run: the page appends `--force STEP=TOKEN` to branch.

Built from the document alone (its prompt, model, device, dtype and resolved ``config``): every setting the
`sample` command takes as an option, written as that option (`--top-p 0.9`, `--logit-bias 42=-inf`, `--stop`
once per string), so the command reads back to the same settings and, with the run's seed, the same draws: a
forced step keeps every other step's random draws (core/methods/branch.py), so the steps before STEP are the
trace's own."""

from __future__ import annotations

from ...core.sampling.registry import params
from ...core.settings import option_name
from ..options import PARAMETERS

FLAGS = ("ignore_eos", "trim_stop", "compile")  # on/off options that take no value (any other true/false value too)


def sample_options() -> set[str]:
    """The settings `sample` takes as options: the parameters the command declared (``compile_`` is --compile), as
    cli/options.py's ``command`` recorded them when the command module was imported (the CLI imports every
    command before it runs one)."""
    if "sample" not in PARAMETERS:
        raise RuntimeError("the sample command is not registered: import decodelab.cli.main first")
    return {name.rstrip("_") for name in PARAMETERS["sample"]}


def _number(value) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _bias(value) -> str:
    """A bias as the option reads it: JSON has no infinity, so a ban was saved as null."""
    return "-inf" if value is None else _number(value)


def option_words(key: str, value) -> list[str]:
    """One setting as command-line words; [] when the value is the option's absence (None, empty, a flag off).
    Every other value is written, defaults included (`--cache full`, `--seed 0`): the command says all that
    reproduces the run, and needs no settings class (which would load torch) to know the defaults."""
    name = option_name(key)
    pairs = {p.field for p in params() if p.pairs}
    if key in pairs:
        return [w for token, bias in (value or {}).items() for w in (name, f"{token}={_bias(bias)}")]
    if isinstance(value, (list, tuple)):
        if key == "chain":
            return [name, ",".join(value)]
        return [w for item in value for w in (name, str(item))]
    if key in FLAGS or isinstance(value, bool):
        if value is None or value is False and key != "trim_stop":
            return []
        return [name] if value else ["--set", f"{key}=false"]  # trim_stop false overrides the semantics' default
    if value is None:
        return []
    return [name, _number(value)]


def sample_command(doc: dict) -> dict | None:
    """``{"argv": [...], "prompt_at": i, "force_at": j}``: the words of the command, where the prompt is and where
    `--force` words go; None when the document holds no run to rerun (no config or prompt)."""
    config, prompt = doc.get("config"), doc.get("prompt")
    if not isinstance(config, dict) or not isinstance(prompt, dict) or not isinstance(prompt.get("text"), str):
        return None
    accepted = sample_options()
    words = ["-m", str(doc.get("model"))]
    if doc.get("device"):
        words += ["--device", str(doc["device"]).split(":")[0]]
    if doc.get("dtype"):
        words += ["--dtype", str(doc["dtype"])]
    if prompt.get("chat") is True:  # the prompt ran through the chat template: so must the rerun
        words += ["--chat"]
    steps = doc.get("steps") or []
    for key, value in config.items():
        if key not in accepted:
            continue
        if key == "max_new_tokens" and steps and isinstance(steps[-1].get("index"), int):
            value = max(value, steps[-1]["index"] + 1)  # a resumed trace: its steps count from the first run's
        words += option_words(key, value)
    text = prompt["text"]
    if text.startswith("-"):  # a prompt that reads as an option goes after "--"
        return {"argv": ["decodelab", "sample"] + words + ["--", text], "prompt_at": 3 + len(words),
                "force_at": 2 + len(words)}
    return {"argv": ["decodelab", "sample", text] + words, "prompt_at": 2, "force_at": 3 + len(words)}


"""Option definitions shared by the commands, defined once as Annotated aliases."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

RUN = "Model and run"
PROC = "Processor chain"
OUT = "Output"


class Format(str, Enum):
    table = "table"
    json = "json"
    jsonl = "jsonl"
    markdown = "markdown"
    csv = "csv"


Prompt = Annotated[Optional[str], typer.Argument(help="The prompt text; '-' reads stdin.", show_default=False)]
PromptFile = Annotated[Optional[Path], typer.Option("--prompt-file", help="Read the prompt from a file.",
                                                    rich_help_panel=RUN)]
Model = Annotated[str, typer.Option("--model", "-m", help="Bundled name (tiny, tiny-draft), a local model folder, "
                                    "or a model id already in the local HF cache. Never downloads.",
                                    rich_help_panel=RUN)]
Preset = Annotated[Optional[str], typer.Option("--preset", "-p", help="Bundled preset name or a path to a .toml.",
                                               rich_help_panel=RUN)]
Set = Annotated[Optional[list[str]], typer.Option("--set", help="Override one setting: KEY=VALUE (repeatable).",
                                                  rich_help_panel=RUN)]
MaxNew = Annotated[Optional[int], typer.Option("--max-new-tokens", "-n", help="Tokens to generate (default 64; beam: 32).",
                                               rich_help_panel=RUN, show_default=False)]
Seed = Annotated[Optional[int], typer.Option("--seed", help="RNG seed: the same command prints the same trace "
                                             "(default 0).", rich_help_panel=RUN, show_default=False)]
Device = Annotated[str, typer.Option("--device", help="auto (cuda, then mps, then cpu), cpu, cuda, mps.",
                                     rich_help_panel=RUN)]
Dtype = Annotated[str, typer.Option("--dtype", help="auto, float32, bfloat16, float16.", rich_help_panel=RUN)]
DeviceMap = Annotated[Optional[str], typer.Option("--device-map", help="'auto' hands a model too large for one "
                                                  "device to transformers/accelerate.", rich_help_panel=RUN)]
TrustRemoteCode = Annotated[bool, typer.Option("--trust-remote-code", help="Allow a local model's own Python code "
                                               "(off by default).", rich_help_panel=RUN)]
Chat = Annotated[bool, typer.Option("--chat", help="Apply the tokenizer's chat template to the prompt.",
                                    rich_help_panel=RUN)]
Stop = Annotated[Optional[list[str]], typer.Option("--stop", help="Extra stop string (repeatable).",
                                                   rich_help_panel=RUN)]
IgnoreEos = Annotated[Optional[bool], typer.Option("--ignore-eos", help="Generate exactly -n tokens.",
                                                   rich_help_panel=RUN, show_default=False)]

Fmt = Annotated[Format, typer.Option("--format", "-f", help="table (rich), json, jsonl (streamed), markdown, csv.",
                                     rich_help_panel=OUT)]
Top = Annotated[Optional[int], typer.Option("--top", help="Alternatives listed per step (default 5).",
                                            rich_help_panel=OUT, show_default=False)]
SaveHtml = Annotated[Optional[Path], typer.Option("--save-html", help="Also write the rendered table as HTML.",
                                                  rich_help_panel=OUT)]
SaveSvg = Annotated[Optional[Path], typer.Option("--save-svg", help="Also write the rendered table as SVG.",
                                                 rich_help_panel=OUT)]

Temperature = Annotated[Optional[float], typer.Option("--temperature", "-t", help="Divide logits by T; 0 = greedy.",
                                                      rich_help_panel=PROC)]
TopK = Annotated[Optional[int], typer.Option("--top-k", help="Keep the k most likely tokens.", rich_help_panel=PROC)]
TopP = Annotated[Optional[float], typer.Option("--top-p", help="Keep the smallest set reaching this mass, (0, 1].",
                                               rich_help_panel=PROC)]
MinP = Annotated[Optional[float], typer.Option("--min-p", help="Keep tokens with p >= min_p * p_max, [0, 1].",
                                               rich_help_panel=PROC)]
TypicalP = Annotated[Optional[float], typer.Option("--typical-p", help="Locally typical sampling mass, (0, 1].",
                                                   rich_help_panel=PROC)]
Softcap = Annotated[Optional[float], typer.Option("--softcap", help="c * tanh(z / c) on the logits, c > 0.",
                                                  rich_help_panel=PROC)]
LogitBias = Annotated[Optional[list[str]], typer.Option("--logit-bias", help="TOKEN=BIAS (repeatable); TOKEN is an "
                                                        "id or a text that is one token; -inf bans it.",
                                                        rich_help_panel=PROC)]
RepetitionPenalty = Annotated[Optional[float], typer.Option("--repetition-penalty", help="Divide positive / multiply "
                                                            "negative logits of seen tokens (> 0; 1 = off).",
                                                            rich_help_panel=PROC)]
NoRepeatNgram = Annotated[Optional[int], typer.Option("--no-repeat-ngram", help="Ban tokens completing an n-gram "
                                                      "already in the text.", rich_help_panel=PROC)]
ChainOrder = Annotated[Optional[str], typer.Option(
    "--chain", help="Explicit stage order, e.g. 'bias,softcap,temperature,top-k,top-p'. Default order: softcap, "
    "repetition-penalty, no-repeat-ngram, bias, temperature, top-k, top-p, min-p, typical-p (only set stages run).",
    rich_help_panel=PROC)]

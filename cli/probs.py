"""`decodelab probs`: the next-token distribution after every stage of the chain, without generating."""

from __future__ import annotations

from rich.table import Table

from ..core.config import SampleSettings, as_dict, resolve, validate_sample
from ..core.decode import next_token_stages
from . import options as o
from . import render
from .pipeline import chain_options, load, make_chain, read_prompt

DEFAULT_TOP = 10


def probs(
    prompt: o.Prompt = None,
    prompt_file: o.PromptFile = None,
    model: o.Model = "tiny",
    preset: o.Preset = None,
    set_: o.Set = None,
    device: o.Device = "auto",
    dtype: o.Dtype = "auto",
    device_map: o.DeviceMap = None,
    trust_remote_code: o.TrustRemoteCode = False,
    chat: o.Chat = False,
    fmt: o.Fmt = o.Format.table,
    top: o.Top = None,
    save_html: o.SaveHtml = None,
    save_svg: o.SaveSvg = None,
    temperature: o.Temperature = None,
    top_k: o.TopK = None,
    top_p: o.TopP = None,
    min_p: o.MinP = None,
    typical_p: o.TypicalP = None,
    softcap: o.Softcap = None,
    logit_bias: o.LogitBias = None,
    repetition_penalty: o.RepetitionPenalty = None,
    no_repeat_ngram: o.NoRepeatNgram = None,
    chain: o.ChainOrder = None,
) -> None:
    """Show how each stage of the chain reshapes the next-token distribution (top tokens, kept, entropy)."""
    text = read_prompt(prompt, prompt_file)
    explicit = chain_options(temperature, top_k, top_p, min_p, typical_p, softcap, logit_bias, repetition_penalty,
                             no_repeat_ngram, chain)
    explicit["top"] = top if top is not None else DEFAULT_TOP
    settings = resolve(SampleSettings, preset, explicit, set_)
    validate_sample(settings)
    lm = load(model, device, dtype, device_map, trust_remote_code)
    processors = make_chain(lm, settings)
    prompt_ids = lm.encode(text, chat)
    stages, tracked = next_token_stages(lm.model, prompt_ids, processors, lm.token_text, settings.top,
                                        lm.context_length)
    names = [s.name for s in stages]
    if fmt == o.Format.json or fmt == o.Format.jsonl:
        doc = render.document("probs", lm, as_dict(settings), processors.names, text, prompt_ids,
                              stages=stages, tokens=tracked)
        (render.print_json if fmt == o.Format.json else render.print_jsonl)(doc)
    elif fmt in (o.Format.markdown, o.Format.csv):
        rows = []
        for t in tracked:
            row = {"token_id": t.token_id, "token": render.show_token(t.token), "logit": t.logit}
            row.update({f"p_{name}": t.probs[name] for name in names})
            rows.append(row)
        render.print_rows(rows, fmt.value)
    if fmt == o.Format.table or save_html or save_svg:
        render.show([tokens_table(tracked, names, lm.name), stages_table(stages)], save_html, save_svg,
                    to_screen=fmt == o.Format.table)


def tokens_table(tracked, names: list[str], model_name: str) -> Table:
    table = Table(title=f"{model_name} · next-token probability after each stage", header_style="bold")
    table.add_column("token")
    table.add_column("id", justify="right")
    table.add_column("logit", justify="right")
    for name in names:
        table.add_column(f"{name}\np (rank)", justify="right")
    for t in tracked:
        cells = []
        for name in names:
            p, rank = t.probs[name], t.ranks[name]
            cells.append(f"{render.fmt_p(p)} ({rank})" if rank is not None else "[dim]removed[/dim]")
        table.add_row(render.show_token(t.token), str(t.token_id), f"{t.logit:.3f}", *cells)
    return table


def stages_table(stages) -> Table:
    table = Table(title="stages", header_style="bold")
    for col in ("stage", "kept", "entropy (nats)", "mass removed"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for s in stages:
        table.add_row(s.name, str(s.kept), f"{s.entropy:.3f}", f"{s.mass_removed:.4f}")
    return table

"""`decodelab sample`: greedy or sampled decoding through the processor chain, one traced row per token."""

from __future__ import annotations

from ..core.config import SampleSettings, as_dict, resolve, validate_sample
from ..core.decode import Sampler, StopRules
from ..core.select import make_selector
from . import options as o
from . import render
from .pipeline import chain_options, load, make_chain, read_prompt


def sample(
    prompt: o.Prompt = None,
    prompt_file: o.PromptFile = None,
    model: o.Model = "tiny",
    preset: o.Preset = None,
    set_: o.Set = None,
    max_new_tokens: o.MaxNew = None,
    seed: o.Seed = None,
    device: o.Device = "auto",
    dtype: o.Dtype = "auto",
    device_map: o.DeviceMap = None,
    trust_remote_code: o.TrustRemoteCode = False,
    chat: o.Chat = False,
    stop: o.Stop = None,
    ignore_eos: o.IgnoreEos = None,
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
    """Generate text token by token and show, per token, the processed and the raw probability."""
    text = read_prompt(prompt, prompt_file)
    explicit = chain_options(temperature, top_k, top_p, min_p, typical_p, softcap, logit_bias, repetition_penalty,
                             no_repeat_ngram, chain)
    explicit.update(max_new_tokens=max_new_tokens, seed=seed, top=top, ignore_eos=ignore_eos,
                    stop=tuple(stop) if stop else None)
    settings = resolve(SampleSettings, preset, explicit, set_)
    validate_sample(settings)
    lm = load(model, device, dtype, device_map, trust_remote_code)
    processors = make_chain(lm, settings)
    prompt_ids = lm.encode(text, chat)
    rules = StopRules(settings.max_new_tokens, tuple(lm.eos_ids), settings.stop, settings.ignore_eos,
                      lm.context_length)
    selector = make_selector(settings.temperature, settings.seed, lm.device)
    sampler = Sampler(lm.model, prompt_ids, processors, selector, rules, lm.token_text, lm.decode, settings.top)
    head = render.document("sample", lm, as_dict(settings), processors.names, text, prompt_ids,
                           selector=selector.name)
    try:
        for step in sampler:
            if fmt == o.Format.jsonl:
                render.print_jsonl({"type": "step", **render.clean(step)})
    except KeyboardInterrupt:
        sampler.interrupt()
    token_ids = sampler.new_ids
    out_text = lm.decode(token_ids)
    summary = sampler.summary()
    if fmt == o.Format.jsonl:
        render.print_jsonl({"type": "summary", "command": "sample", "model": lm.name, "text": out_text,
                            "token_ids": token_ids, **render.clean(summary)})
    elif fmt == o.Format.json:
        render.print_json({**head, "steps": sampler.steps, "text": out_text, "token_ids": token_ids,
                           "summary": summary})
    elif fmt in (o.Format.markdown, o.Format.csv):
        render.print_rows(render.step_rows(sampler.steps), fmt.value)
    if fmt == o.Format.table or save_html or save_svg:
        views = [
            render.steps_table(sampler.steps, settings.top, title=f"{lm.name} · chain: "
                               f"{' -> '.join(processors.names + [selector.name])}"),
            render.shaded_text(text, [(s.token, s.prob) for s in sampler.steps]),
            render.summary_line(summary),
        ]
        render.show(views, save_html, save_svg, to_screen=fmt == o.Format.table)

"""The stages of core/samplers.py: against transformers' own processors where one exists, against vectors computed
by hand from the published formula where none does, and inside a decode run (state carried, seed reproduces)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import NEG, random_model
from transformers.generation import logits_process as hf

from decodelab.core.sampling.settings import ChainSettings
from decodelab.core.methods.sample import SampleSettings, validate_sample
from decodelab.core.settings import PAIRS, coerce
from decodelab.core.sampling.chain import validate_chain
from decodelab.core.methods.sample import Sampler
from decodelab.core.engine.stopping import StopRules
from decodelab.core.errors import ChainError, ConfigError
from decodelab.core.sampling.chain import Chain, build_chain
from decodelab.core.sampling.distribution import softmax
from decodelab.core.sampling.penalties import DRY, FrequencyPenalty, PresencePenalty, WindowedRepetitionPenalty, z_function
from decodelab.core.sampling.filters import XTC, EpsilonCutoff, EtaCutoff, MirostatV2, TopNSigma
from decodelab.core.sampling.biases import AllowList, Ban, MinNewTokens, SequenceBias
from decodelab.core.sampling.scaling import DynamicTemperature
from decodelab.core.sampling.select import make_generator
from conftest import build
from decodelab.core.sampling import replay
from decodelab.core.engine.stopping import StopChecker, trim_stop


def random_case(seed: int, batch: int = 4, length: int = 12, vocab: int = 40):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen) * 3
    logits[0, :4] = NEG  # candidates an earlier stage removed
    ids = torch.randint(0, 8, (batch, length), generator=gen)  # few ids: repeats and matching prefixes
    return ids, logits


def assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(torch.isneginf(got), torch.isneginf(expected))
    finite = ~torch.isneginf(expected)
    torch.testing.assert_close(got[finite], expected[finite], rtol=1e-6, atol=1e-6)


# --- against transformers --------------------------------------------------------------------------------------

SEQS = {(3,): 1.5, (2, 5): -2.0, (1, 2, 6): 3.0, (7, 7): -0.5, (4,): -1.0}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ours,theirs", [
    (EpsilonCutoff(3e-2), hf.EpsilonLogitsWarper(3e-2)),
    (EpsilonCutoff(0.2), hf.EpsilonLogitsWarper(0.2)),  # removes all but the top in some rows: the top stays
    (EtaCutoff(1e-2), hf.EtaLogitsWarper(1e-2)),
    (EtaCutoff(0.3), hf.EtaLogitsWarper(0.3)),
    (SequenceBias(tuple(SEQS.items())), hf.SequenceBiasLogitsProcessor(dict(SEQS))),
    (Ban(sequences=((3,), (2, 5), (1, 2, 6))), hf.NoBadWordsLogitsProcessor([[3], [2, 5], [1, 2, 6]])),
    (WindowedRepetitionPenalty(penalty=1.4), hf.RepetitionPenaltyLogitsProcessor(1.4)),
    (WindowedRepetitionPenalty(penalty=0.7), hf.RepetitionPenaltyLogitsProcessor(0.7)),
], ids=lambda p: getattr(p, "name", type(p).__name__))
def test_matches_transformers(ours, theirs, seed):
    ids, logits = random_case(seed)
    assert_same(ours(ids, logits), theirs(ids.clone(), logits.clone()))


def test_sequence_bias_multi_token_actually_matched():
    """Guard for the test above: with these ids some multi-token prefixes match, some do not."""
    ids = torch.tensor([[0, 1, 2], [0, 0, 7]])
    out = SequenceBias(tuple(SEQS.items()))(ids, torch.zeros(2, 10))
    assert out[0, 6] == 3.0 and out[1, 6] == 0.0  # (1, 2) -> 6 only in row 0
    assert out[1, 7] == -0.5 and out[0, 7] == 0.0  # (7,) -> 7 only in row 1
    assert out[0, 5] == -2.0 and out[1, 5] == 0.0


@pytest.mark.parametrize("generated", [0, 2, 3, 5])
def test_min_new_tokens_matches_transformers(generated):
    prompt_len, n, eos = 7, 3, (4, 9)
    ids, logits = random_case(1, length=prompt_len + generated)
    stage = MinNewTokens(n, eos)
    stage.reset(prompt_len)
    theirs = hf.MinNewTokensLengthLogitsProcessor(prompt_len, n, list(eos))
    assert_same(stage(ids, logits), theirs(ids.clone(), logits.clone()))
    assert bool(torch.isneginf(stage(ids, logits)[1, 4])) == (generated < n)


@pytest.mark.parametrize("last_n", [1, 4, 30])
def test_repetition_window_is_the_transformers_penalty_on_the_last_n(last_n):
    ids, logits = random_case(2)
    ours = WindowedRepetitionPenalty(penalty=1.5, last_n=last_n)(ids, logits)
    theirs = hf.RepetitionPenaltyLogitsProcessor(1.5)(ids[:, -last_n:].clone(), logits.clone())
    assert_same(ours, theirs)


def test_stages_never_edit_their_input():
    ids, logits = random_case(3)
    before = logits.clone()
    stages = [EpsilonCutoff(0.05), EtaCutoff(0.05), SequenceBias(tuple(SEQS.items())), AllowList((1, 2, 3)),
              TopNSigma(1.0), FrequencyPenalty(value=0.5), PresencePenalty(value=0.5), DRY(1.0, 2.0, 1),
              DynamicTemperature(1.0, 0.5), MirostatV2(), XTC(0.05, 1.0, make_generator(0, "cpu")),
              WindowedRepetitionPenalty(penalty=1.3, last_n=3)]
    for stage in stages:
        stage(ids, logits)
        assert torch.equal(logits, before), stage.name


# --- hand-computed from the published formulas ------------------------------------------------------------------


def test_presence_and_frequency_penalties_by_hand():
    z = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    ids = torch.tensor([[0, 0, 1]])
    freq = FrequencyPenalty(value=0.25)(ids, z)
    pres = PresencePenalty(value=0.5)(ids, z)
    assert freq.tolist() == [[0.5, 1.75, 3.0, 4.0, 5.0]]  # z - 0.25 * count: counts 2, 1
    assert pres.tolist() == [[0.5, 1.5, 3.0, 4.0, 5.0]]  # z - 0.5 once seen
    out_only = PresencePenalty(value=0.5, scope="output")
    out_only.reset(2)  # the prompt is [0, 0]: only the generated 1 counts
    assert out_only(ids, z).tolist() == [[1.0, 1.5, 3.0, 4.0, 5.0]]
    window = FrequencyPenalty(value=0.25, last_n=2)  # [0, 1]
    assert window(ids, z).tolist() == [[0.75, 1.75, 3.0, 4.0, 5.0]]
    assert FrequencyPenalty(value=0.25, last_n=0)(ids, z).tolist() == z.tolist()


def test_output_only_penalty_without_reset_is_an_error():
    with pytest.raises(ChainError, match="prompt ends"):
        PresencePenalty(value=0.5, scope="output")(torch.tensor([[1]]), torch.zeros(1, 4))


def brute_dry(h, multiplier, base, allowed, breakers=()):
    """DRY by its definition, quadratic: for each j the longest common suffix of h[:j+1] and h, capped by the
    tokens after the last single-token breaker."""
    n = len(h)
    if n <= allowed:
        return {}
    after = [n - 1 - i for i in range(n) if h[i] in breakers]
    limit = min(after) if after else n
    if limit < allowed:
        return {}
    best = {}
    for j in range(n - 1):
        m = 0
        while m <= j and h[j - m] == h[n - 1 - m]:
            m += 1
        m = min(m, limit)
        if m >= allowed:
            best[h[j + 1]] = max(best.get(h[j + 1], 0), m)
    return {t: multiplier * base ** (m - allowed) for t, m in best.items() if t not in breakers}


def test_dry_by_hand_on_llamacpps_example():
    # llama.cpp's comment: "a b c c b c y a b c" -> c would extend "a b c" (3), y would extend "b c" (2)
    a, b, c, y = 0, 1, 2, 3
    h = [a, b, c, c, b, c, y, a, b, c]
    assert DRY(1.0, 2.0, 2).penalties(h) == {c: 2.0, y: 1.0}  # 1 * 2^(3-2), 1 * 2^(2-2)
    assert DRY(1.0, 2.0, 2, breakers=((y,),)).penalties(h) == {c: 2.0}  # y breaks: never penalized itself
    assert DRY(1.0, 2.0, 2, breakers=((a,),)).penalties(h) == {c: 1.0, y: 1.0}  # 2 tokens after the last a
    assert DRY(1.0, 2.0, 2, breakers=((b, c),)).penalties(h) == {}  # "b c" ends the window: limit 0
    z = torch.zeros(1, 4)
    out = DRY(1.0, 2.0, 2)(torch.tensor([h]), z)
    assert out.tolist() == [[0.0, 0.0, -2.0, -1.0]]


@pytest.mark.parametrize("seed", range(20))
def test_dry_z_algorithm_equals_the_quadratic_definition(seed):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randint(0, 3, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen).tolist()
    for allowed in (0, 1, 2, 4):
        for breakers in ((), (2,)):
            stage = DRY(0.8, 1.75, allowed, breakers=tuple((t,) for t in breakers))
            got = stage.penalties(h)
            want = brute_dry(h, 0.8, 1.75, allowed, breakers)
            assert got.keys() == want.keys() and all(math.isclose(got[k], want[k]) for k in got)


def test_z_function():
    assert z_function([0, 0, 1, 0, 0, 1, 0]) == [7, 1, 0, 4, 1, 0, 1]


def test_dry_exponent_is_capped_so_the_penalty_stays_finite():
    h = [5] * 300
    pen = DRY(1.0, 3.0, 1).penalties(h)
    assert math.isfinite(pen[5]) and pen[5] == 3.0 ** int(88.7228391 / math.log(3.0))



def test_dry_exponent_cap_at_the_default_base_and_no_cap_needed_at_base_one():
    """At the default base 1.75 the cap is int(88.7228391 / log 1.75) = 158 (1.75 ** 158 = 2.7e38 still fits a
    float32; 1.75 ** 298 would not). At base 1 every power is 1, so the penalty is the multiplier, whatever the
    repeat's length (and log 1 = 0 must not be divided by). An empty sequence breaker (a breaker string that
    tokenizes to nothing) is dropped. Bugs caught: the cap applied only above base 2, the cap computed at base 1,
    an empty breaker kept (its head read)."""
    h = [5] * 300
    pen = DRY(1.0, 1.75, 2).penalties(h)
    assert int(88.7228391 / math.log(1.75)) == 158 and pen == {5: 1.75 ** 158}
    assert math.isfinite(torch.tensor([0.0]).sub(pen[5]).item())
    assert DRY(0.5, 1.0, 2).penalties(h) == {5: 0.5}
    dry = DRY(1.0, 1.75, 2, breakers=((), (7,)))
    assert dry.breakers == ((7,),) and dry.penalties([1, 2, 3, 1, 2]) == {3: 1.0}


@pytest.mark.parametrize("make,message", [
    (lambda: WindowedRepetitionPenalty(penalty=0), "--repetition-penalty 0: must be > 0 (1 = off)"),
    (lambda: WindowedRepetitionPenalty(penalty=float("inf")), "--repetition-penalty inf: must be > 0 (1 = off)"),
    (lambda: WindowedRepetitionPenalty(scope="prompt", penalty=1.2),
     "--repetition-penalty scope prompt: allowed: all, output"),
    (lambda: FrequencyPenalty(value=float("nan")), "--frequency-penalty nan: must be a finite number"),
    (lambda: FrequencyPenalty(scope="prompt", value=0.5), "--frequency-penalty scope prompt: allowed: all, output"),
    (lambda: PresencePenalty(value=float("inf")), "--presence-penalty inf: must be a finite number"),
    (lambda: PresencePenalty(scope="prompt", value=0.5), "--presence-penalty scope prompt: allowed: all, output"),
    (lambda: DRY(0.0), "--dry-multiplier 0.0: must be > 0 (0 = off)"),
    (lambda: DRY(1.0, allowed_length=-1), "--dry-allowed-length -1: must be an integer >= 0"),
    (lambda: DRY(1.0, allowed_length=1.5), "--dry-allowed-length 1.5: must be an integer >= 0"),
    (lambda: FrequencyPenalty(last_n=-1, value=0.5),
     "--penalty-last-n -1: must be an integer >= 0 (0 switches the penalties off)"),
    (lambda: PresencePenalty(last_n=2.5, value=0.5),
     "--penalty-last-n 2.5: must be an integer >= 0 (0 switches the penalties off)"),
    (lambda: DRY(1.0, last_n=0), "--dry-penalty-last-n 0: must be an integer >= 1 (or unset for all tokens)"),
    (lambda: DRY(1.0, last_n=2.5), "--dry-penalty-last-n 2.5: must be an integer >= 1 (or unset for all tokens)"),
    (lambda: DynamicTemperature(-0.5, 0.5), "--temperature -0.5: must be >= 0"),
    (lambda: DynamicTemperature(float("inf"), 0.5), "--temperature inf: must be >= 0"),
    (lambda: DynamicTemperature(1.0, 0.0), "--dynatemp-range 0.0: must be > 0 (0 = plain temperature)"),
    (lambda: DynamicTemperature(1.0, float("nan")), "--dynatemp-range nan: must be > 0 (0 = plain temperature)"),
    (lambda: DynamicTemperature(1.0, 0.5, 0.0), "--dynatemp-exponent 0.0: must be > 0"),
    (lambda: DynamicTemperature(1.0, 0.5, float("inf")), "--dynatemp-exponent inf: must be > 0"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_penalty_and_dynatemp_stages_built_directly_refuse_in_one_whole_line(make, message):
    """A stage built in a script (not through the CLI's checks) refuses a bad value in the CLI's own line: option,
    value, what is allowed. At the edges: a repetition penalty of 0 or inf, a non-finite alpha, a scope that is
    not one of SCOPES, a DRY multiplier of 0, a negative or fractional allowed length, a negative or infinite
    temperature, a dynamic-temperature range or exponent of 0 or not finite, a negative or fractional penalty
    window, a DRY window of 0 or fractional. Bug caught: a check that
    lets the value through (`or` for `and`, `>=` for `>`), or a line that names the wrong option or value."""
    with pytest.raises(ConfigError) as err:
        make()
    assert str(err.value) == message



def test_an_output_only_penalty_run_without_the_prompt_length_is_one_whole_line():
    """scope="output" counts only what was generated, so it must know where the prompt ends; a script that calls
    the stage without Chain.reset(prompt_len) gets one line naming the stage and the call it missed."""
    ids, logits = torch.tensor([[1, 2, 3]]), torch.zeros(1, 5)
    with pytest.raises(ChainError) as err:
        FrequencyPenalty(scope="output", value=0.5)(ids, logits)
    assert str(err.value) == ("frequency-penalty: counts generated tokens only, but the run never said where the "
                              "prompt ends (Chain.reset(prompt_len))")


def test_penalty_stages_accept_the_values_next_to_their_edges():
    """A repetition penalty between 0 and 1 (it favours repeats: allowed), alpha 0 or negative, DRY at base 1 and
    allowed length 0, dynamic temperature at t = 0, a penalty window of 0 (off) and a DRY window of 1 are all
    valid."""
    DynamicTemperature(0.0, 0.5, 0.5)
    FrequencyPenalty(last_n=0, value=0.5)
    DRY(1.0, last_n=1)
    WindowedRepetitionPenalty(penalty=0.5)
    FrequencyPenalty(value=-1.0)
    PresencePenalty(value=0.0)
    DRY(0.1, base=1.0, allowed_length=0)


def test_xtc_by_hand():
    z = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    gen = make_generator(0, "cpu")
    always = XTC(0.15, 1.0, gen)
    assert softmax(always(None, z))[0].tolist() == pytest.approx([0, 0, 2 / 3, 1 / 3])  # 0.4, 0.3 go; 0.2 stays
    assert torch.equal(XTC(0.35, 1.0, gen)(None, z), z)  # one token reaches 0.35: nothing happens
    assert torch.equal(XTC(0.15, 0.0, gen)(None, z), z)  # the coin never says yes


def test_xtc_coin_comes_from_the_generator_and_has_the_right_rate():
    z = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log().expand(4000, -1)
    runs = []
    for _ in range(2):
        stage = XTC(0.15, 0.3, make_generator(7, "cpu"))
        runs.append(torch.isneginf(stage(None, z)[:, 0]))
    assert torch.equal(runs[0], runs[1])  # the same seed, the same coins
    rate = runs[0].float().mean().item()
    assert abs(rate - 0.3) < 4 * math.sqrt(0.3 * 0.7 / 4000)  # applied with probability 0.3
    with pytest.raises(ChainError, match="generator"):
        XTC(0.1, 0.5)(None, z)


def test_top_n_sigma_by_hand_and_temperature_invariant():
    z = torch.tensor([[0.0, 1.0, 2.0, 3.0, NEG]])  # finite: mean 1.5, sigma sqrt(1.25) = 1.118
    keep = lambda n, zz: (~torch.isneginf(TopNSigma(n)(None, zz)))[0].tolist()  # noqa: E731
    assert keep(1.0, z) == [False, False, True, True, False]  # z >= 3 - 1.118
    assert keep(2.0, z) == [False, True, True, True, False]  # z >= 3 - 2.236
    assert keep(1.0, z / 0.3) == keep(1.0, z)


def test_dynamic_temperature_by_hand():
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    h = -(p * p.log()).sum().item()
    t = 0.5 + (1.5 - 0.5) * (h / math.log(4)) ** 2.0  # t=1, range 0.5, exponent 2
    stage = DynamicTemperature(1.0, 0.5, 2.0)
    out = stage(None, p.log()[None])
    torch.testing.assert_close(softmax(out)[0], torch.softmax(p.log() / t, -1), rtol=1e-6, atol=1e-7)
    assert stage.state()["temperature"].item() == pytest.approx(t)
    # a near point mass has entropy ~0: T ~ T_min = 0, sharper still
    sharp = DynamicTemperature(0.2, 0.2)
    out = sharp(None, torch.tensor([[8.0, 0.0, 0.0]]))
    assert sharp.state()["temperature"].item() < 0.01 and softmax(out)[0, 0] == 1.0



def test_dynamic_temperature_per_row_and_at_its_edges():
    """A batch of rows with different candidate counts K: each row's T uses its own K (log K normalises its own
    entropy) and the state holds one T per row, [B]. A row with one candidate is left as it is and reports T = 1;
    a row with two candidates gets its computed T. T reaching exactly 0 (T_min = max(0, 0.5 - 0.5) = 0 and a
    softmax that underflows to a point mass, entropy 0) keeps only the arg-max, as T < 0 does: the -1000 logit is
    removed, not left finite. Before any step the state is empty. Bugs caught: K counted over the whole batch, T
    reported for a single candidate or computed only from three, the state shaped [B, 1], "T < 0" for "T <= 0",
    the arg-max taken across the batch, a None state reported before the first step."""
    stage = DynamicTemperature(1.0, 0.5)
    assert stage.state() == {}
    rows = torch.tensor([[1.0, 0.0, -1.0, 0.5], [2.0, 0.0, NEG, NEG], [3.0, NEG, NEG, NEG]])
    out = stage(None, rows)
    temps = []
    for row in rows:
        finite = row[torch.isfinite(row)]
        if finite.numel() == 1:
            temps.append(1.0)
            continue
        p = torch.softmax(finite, -1)
        h = -(p * p.log()).sum().item()
        temps.append(0.5 + (1.5 - 0.5) * h / math.log(finite.numel()))
    state = stage.state()["temperature"]
    assert state.shape == (3,) and state.tolist() == pytest.approx(temps, rel=1e-6)
    torch.testing.assert_close(out[:2], rows[:2] / torch.tensor(temps[:2])[:, None], rtol=1e-6, atol=0)
    assert torch.equal(out[2], rows[2])
    zero = DynamicTemperature(0.5, 0.5)
    out = zero(None, torch.tensor([[0.0, -1000.0]]))
    assert zero.state()["temperature"].tolist() == [0.0]
    assert out.tolist() == [[0.0, NEG]]
    # each row of a batch keeps its own arg-max (here on either side)
    assert zero(None, torch.tensor([[-1000.0, 0.0], [0.0, -1000.0]])).tolist() == [[NEG, 0.0], [0.0, NEG]]


def test_mirostat_v2_by_hand():
    z = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()  # surprises 1, 2, 3, 3 bits
    m = MirostatV2(tau=1.5, eta=0.1)
    out = m(None, z)  # mu = 2 tau = 3: all kept
    assert not torch.isneginf(out).any() and m.mu.item() == 3.0
    m.accept(torch.tensor([0]))  # observed 1 bit: mu = 3 - 0.1 (1 - 1.5)
    assert m.mu.item() == pytest.approx(3.05)
    m = MirostatV2(tau=1.0, eta=0.1)  # mu = 2: keeps surprises <= 2, renormalized to 2/3, 1/3
    out = m(None, z)
    assert softmax(out)[0].tolist() == pytest.approx([2 / 3, 1 / 3, 0, 0])
    m.accept(torch.tensor([1]))
    assert m.mu.item() == pytest.approx(2 - 0.1 * (math.log2(3) - 1.0))
    m.mu = torch.tensor([0.1])  # below every surprise: the most likely token stays
    assert (~torch.isneginf(m(None, z)))[0].tolist() == [True, False, False, False]


def test_allow_list():
    out = AllowList((3, 1))(None, torch.zeros(1, 5))
    assert torch.isneginf(out)[0].tolist() == [True, False, True, False, True]


@pytest.mark.parametrize("make,message", [
    (lambda: DRY(0.0), "--dry-multiplier 0.0"), (lambda: DRY(1.0, 0.5), "--dry-base 0.5"),
    (lambda: XTC(1.5, 0.5), "--xtc-threshold 1.5"), (lambda: XTC(0.1, -1), "--xtc-probability -1"),
    (lambda: TopNSigma(0), "--top-n-sigma 0"), (lambda: MirostatV2(tau=-1), "--mirostat-tau -1"),
    (lambda: EpsilonCutoff(1.0), "--epsilon-cutoff 1.0"), (lambda: EtaCutoff(0.0), "--eta-cutoff 0.0"),
    (lambda: DynamicTemperature(1.0, 0.0), "--dynatemp-range 0.0"), (lambda: MinNewTokens(-2), "--min-new-tokens"),
    (lambda: FrequencyPenalty(value=float("nan")), "--frequency-penalty nan"),
])
def test_each_stage_checks_its_parameters_in_one_line(make, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as err:
        make()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("fields,message", [
    ({"xtc_probability": 0.5, "xtc_threshold": 2.0}, "--xtc-threshold 2.0"),
    ({"mirostat_eta": 0.0}, "--mirostat-eta 0.0"),
    ({"dynatemp_range": 0.5, "temperature": 0.0}, "--dynatemp-range 0.5"),
    ({"penalty_last_n": -3, "presence_penalty": 0.5}, "--penalty-last-n -3"),
    ({"semantics": "ollama"}, "--semantics 'ollama'"),
])
def test_settings_are_checked_before_any_model(fields, message):
    with pytest.raises(ConfigError, match=message):
        validate_chain(ChainSettings(**fields))


def test_new_settings_default_off_and_coerce_from_presets():
    assert ChainSettings().stage_values(None) == {k: None for k in ChainSettings().stage_values(None)}
    assert coerce(SampleSettings, "sequence_bias", "a b=2,c=-inf") == (("a b", 2.0), ("c", float("-inf")))
    assert coerce(SampleSettings, "stop_id", "3,7") == (3, 7)
    assert coerce(SampleSettings, "ban", ["x y"]) == ("x y",)
    with pytest.raises(ConfigError, match="--stop-id"):
        validate_sample(SampleSettings(stop_id=(-1,)))


# --- in a decode run ------------------------------------------------------------------------------------------

PROMPT = [5, 17, 42, 9, 77, 3]


def sample_run(model, settings: SampleSettings, eos=()):
    plan, chain, selector = build(settings, 256, settings.seed, "cpu", eos_ids=eos, stop_ids=settings.stop_id)
    rules = StopRules(settings.max_new_tokens, tuple(eos), stop_ids=settings.stop_id)
    sampler = Sampler(model, PROMPT, chain, selector, rules, str, None, top=2)
    return list(sampler), sampler


def test_mirostat_state_is_carried_and_traced():
    model = random_model("llama", seed=1, scale=4.0)
    steps, _ = sample_run(model, SampleSettings(mirostat_tau=3.0, mirostat_eta=0.2, max_new_tokens=10, seed=3))
    mus = [s.state["mirostat.mu"] for s in steps]
    assert mus[0] == 6.0  # 2 tau
    for prev, step, mu in zip(steps, steps[1:], mus[1:]):  # mu_{t+1} = mu_t - eta (-log2 p_t - tau)
        assert mu == pytest.approx(prev.state["mirostat.mu"] - 0.2 * (-prev.logprob / math.log(2) - 3.0), abs=1e-4)
    assert len(set(round(m, 4) for m in mus)) > 3  # it really moves


def test_xtc_run_is_reproduced_by_its_seed_and_traces_the_coin():
    model = random_model("qwen2", seed=2, scale=6.0)
    s = SampleSettings(xtc_threshold=0.05, xtc_probability=0.5, temperature=1.0, max_new_tokens=12, seed=11)
    first, _ = sample_run(model, s)
    again, _ = sample_run(model, s)
    assert [x.token_id for x in first] == [x.token_id for x in again]
    assert [x.state["xtc.coin"] for x in first] == [x.state["xtc.coin"] for x in again]
    xtc = [next(st for st in x.stages if st.name == "xtc") for x in first]
    acted = [st.mass_removed > 0 for st in xtc]
    coins = [x.state["xtc.coin"] for x in first]
    assert all(c <= 0.5 for c, a in zip(coins, acted) if a)  # it only ever acts when the coin says so
    other, _ = sample_run(model, SampleSettings(**{**s.__dict__, "seed": 12}))
    assert [x.state["xtc.coin"] for x in other] != coins


def test_min_new_tokens_and_stop_ids_in_a_run():
    model = random_model("gpt2", seed=3, scale=6.0)
    free, _ = sample_run(model, SampleSettings(temperature=0.0, max_new_tokens=8))
    first = free[0].token_id
    steps, sampler = sample_run(model, SampleSettings(temperature=0.0, max_new_tokens=8, stop_id=(first,)))
    assert [s.token_id for s in steps] == [first] and sampler.stop_reason == "stop"
    steps, sampler = sample_run(model, SampleSettings(temperature=0.0, max_new_tokens=8, stop_id=(first,),
                                                      min_new_tokens=3))
    assert first not in [s.token_id for s in steps[:3]]  # banned until 3 tokens exist, stop ids included
    assert sampler.stop_reason in ("stop", "length")


def test_stop_ids_and_trim_stop():
    rules = StopRules(10, eos_ids=(2,), stop_strings=("END",), stop_ids=(9,))
    checker = StopChecker(rules, lambda ids: "".join(chr(65 + i) for i in ids))
    assert checker.check([1, 9], 2) == "stop" and checker.check([1, 2], 2) == "eos"
    detok = lambda ids: "".join({0: "ab", 1: "EN", 3: "Dx", 9: "<s>"}[i] for i in ids)  # noqa: E731
    assert trim_stop([0, 9], "stop", rules, detok) == ([0], "ab")
    assert trim_stop([0, 1, 3], "stop", rules, detok) == ([0, 1, 3], "ab")
    assert trim_stop([0, 1, 3], "length", rules, detok) == ([0, 1, 3], "abENDx")


def test_chain_reset_and_accept_reach_only_the_stages_that_have_them():
    m = MirostatV2()
    chain = Chain([FrequencyPenalty(value=1.0, scope="output"), m])
    assert replay.stateful(chain.names) == ["mirostat"]  # the registry row's state need
    chain.reset(3)
    assert chain.processors[0].prompt_len == 3
    chain(torch.tensor([[1, 2, 3, 4]]), torch.zeros(1, 6))
    chain.accept(torch.tensor([0]))
    assert [k for k, _ in chain.states()] == ["mirostat.mu"]
    assert not replay.stateful(build_chain({"temperature": 0.5}).names)


@pytest.mark.parametrize("record", [True, False])
def test_device_stages_keep_one_transfer_per_token(monkeypatch, record):
    """Penalties, sequence bias, XTC, top-n-sigma, eta, dynamic temperature and mirostat (whose mu travels in the
    trace's one transfer) read nothing on the host: one read per token, traced or not. DRY reads its window."""
    from test_runtime import TransferCounter

    model = random_model("llama", seed=0, scale=4.0)
    s = SampleSettings(frequency_penalty=0.2, presence_penalty=0.1, penalty_last_n=8, sequence_bias=(("3 4", 1.0),),
                       top_n_sigma=2.0, eta_cutoff=1e-3, xtc_probability=0.5, dynatemp_range=0.3, temperature=0.9,
                       mirostat_tau=4.0, min_new_tokens=2, max_new_tokens=12, seed=1)
    _, chain, selector = build(s, 256, s.seed, "cpu", eos_ids=(7,))
    sampler = Sampler(model, PROMPT, chain, selector, StopRules(12, ignore_eos=True), str, None, top=3, record=record)
    counter = TransferCounter(monkeypatch)
    steps = list(sampler)
    assert len(sampler.new_ids) == 12 and counter.count == 12
    if record:
        assert all(set(x.state) == {"xtc.coin", "dynatemp.temperature", "mirostat.mu"} for x in steps)


def test_preset_keys_are_the_option_names_in_snake_case(tmp_path):
    from decodelab.core.settings import resolve

    path = tmp_path / "p.toml"
    path.write_text('dry_multiplier = 0.8\ndry_breaker = ["\\n", ":"]\nxtc_probability = 0.5\nmirostat_tau = 3.0\n'
                    'sequence_bias = { "a b" = 2.0 }\nban = ["x y"]\nstop_id = [7, 9]\nsemantics = "llamacpp"\n')
    s = resolve(SampleSettings, str(path), {}, ["penalty_last_n=16", "trim_stop=true"])
    assert s.dry_breaker == ("\n", ":") and s.sequence_bias == (("a b", 2.0),) and s.stop_id == (7, 9)
    assert s.penalty_last_n == 16 and s.trim_stop is True and s.semantics == "llamacpp" and s.ban == ("x y",)
    validate_sample(s)


def finite_ids(logits: torch.Tensor, row: int = 0) -> list[int]:
    """The candidates a stage kept (finite logits) in row ``row``."""
    return torch.isfinite(logits[row]).nonzero().flatten().tolist()


# --- issue 22: a window shorter than the history, -inf candidates, values between two thresholds or on one ---------


def test_dry_counts_only_the_window_even_when_the_history_repeats_before_it():
    """History 0 1 2 3 0 1: the repeat "0 1" is followed by 2 at the start. Only a window of all 6 tokens sees it
    (n = 2 = L, so z_2 -= 1 * 1.75^0 = 1); windows of 3, 4 and 5 tokens start after the first "0" and see no
    earlier "0 1" (at 5 the earlier "1" is a repeat of length 1 < L)."""
    h = [0, 1, 2, 3, 0, 1]
    assert DRY(1.0).penalties(h) == {2: 1.0}
    logits = torch.zeros(1, 4)
    for last_n, expected in [(3, [0, 0, 0, 0]), (4, [0, 0, 0, 0]), (5, [0, 0, 0, 0]), (6, [0, 0, -1.0, 0]),
                             (None, [0, 0, -1.0, 0])]:
        out = DRY(1.0, last_n=last_n)(torch.tensor([h]), logits)
        assert out[0].tolist() == expected, last_n


def test_top_n_sigma_measures_the_spread_of_the_finite_logits_only():
    """z = (3, 1, -1, -inf): over the three finite logits mean 1, sigma sqrt(8/3) = 1.633; N = 1.3 keeps z >=
    3 - 2.123 = 0.877: tokens 0 and 1. Counting the -inf as a fourth candidate (mean 0.75, sigma 1.431) would cut
    at 1.14 and keep token 0 only."""
    logits = torch.tensor([[3.0, 1.0, -1.0, NEG]])
    assert finite_ids(TopNSigma(1.3)(None, logits)) == [0, 1]
    assert finite_ids(TopNSigma(1.0)(None, logits)) == [0]  # 3 - 1.633 = 1.367


def test_eta_cutoff_takes_the_smaller_of_its_two_thresholds():
    """p = (0.5, 0.3, 0.2) and a removed token: H = 1.0297 nats, sqrt(0.25) e^-H = 0.1786 < 0.25, so eta keeps
    p = 0.2, which lies between the two thresholds (the larger, epsilon 0.25, removes it)."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]]))
    assert finite_ids(EtaCutoff(0.25)(None, logits)) == [0, 1, 2]
    assert finite_ids(EpsilonCutoff(0.25)(None, logits)) == [0, 1]


def test_cutoffs_keep_a_probability_exactly_on_the_threshold():
    """p = (1/2, 1/4, 1/4) exactly in float32: epsilon 1/4 removes only p < 1/4 (nothing here); just above, both
    quarters go. XTC's top choices are p >= T: with T = 1/4 all three reach it and all but the least likely (the
    last quarter, ties by id) go; just above, only 1/2 reaches it and XTC does nothing."""
    logits = torch.tensor([[2.0, 1.0, 1.0]]) * torch.log(torch.tensor(2.0))
    assert finite_ids(EpsilonCutoff(0.25)(None, logits)) == [0, 1, 2]
    assert finite_ids(EpsilonCutoff(0.2500001)(None, logits)) == [0]
    assert finite_ids(XTC(0.25, 1.0, make_generator(0, "cpu"))(None, logits)) == [2]
    assert finite_ids(XTC(0.2500001, 1.0, make_generator(0, "cpu"))(None, logits)) == [0, 1, 2]


# --- mutation run of core/sampling/biases.py (2026-12-01): stages built inside the test (a stage built in a
# parametrize list is made at collection, before the mutation run switches a mutant on) -------------------------


def test_ban_built_here_matches_transformers():
    ids, logits = random_case(0)
    ours = Ban(sequences=((3,), (2, 5), (1, 2, 6)))
    theirs = hf.NoBadWordsLogitsProcessor([[3], [2, 5], [1, 2, 6]])
    assert_same(ours(ids, logits), theirs(ids.clone(), logits.clone()))
    assert ours.biases == (((3,), NEG), ((2, 5), NEG), ((1, 2, 6), NEG))


def test_a_sequence_as_long_as_the_ids_matches_them_all_and_a_longer_one_is_skipped():
    """ids of length 2 = the prefix of (5, 6, 9): the whole history must match, and does; (1, 5, 6, 8) needs three
    ids before 8, more than there are, and is skipped without stopping the sequences after it."""
    stage = SequenceBias((((1, 5, 6, 8), 4.0), ((5, 6, 9), 2.0), ((6, 7), -1.0)))
    out = stage(torch.tensor([[5, 6]]), torch.zeros(1, 10))
    assert out[0].tolist() == [0, 0, 0, 0, 0, 0, 0, -1.0, 0, 2.0]
    theirs = hf.SequenceBiasLogitsProcessor({(1, 5, 6, 8): 4.0, (5, 6, 9): 2.0, (6, 7): -1.0})
    assert_same(out, theirs(torch.tensor([[5, 6]]), torch.zeros(1, 10)))


def test_the_bias_stages_refuse_in_one_exact_line():
    for make, line in [
        (lambda: SequenceBias((((), 1.0),)), "--sequence-bias '': a sequence needs at least one token"),
        (lambda: SequenceBias((((3,), float("nan")),)), "--sequence-bias nan: the bias must be a number or -inf"),
        (lambda: Ban(sequences=((),)), "--ban '': a sequence needs at least one token"),
        (lambda: AllowList(()), "--allow '': give at least one token"),
        (lambda: MinNewTokens(-1), "--min-new-tokens -1: must be an integer >= 0"),
    ]:
        with pytest.raises(ConfigError) as refused:
            make()
        assert str(refused.value) == line
    assert MinNewTokens(0).n == 0, "0 is allowed: no ban"
    with pytest.raises(ChainError) as refused:
        MinNewTokens(2, (1,))(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 5))
    assert str(refused.value) == \
        "min-new-tokens: the run never said where the prompt ends (Chain.reset(prompt_len))"


def test_the_allow_list_checks_both_ends_of_the_vocabulary():
    z = torch.zeros(1, 5)
    assert (~torch.isneginf(AllowList((0, 4))(None, z)))[0].tolist() == [True, False, False, False, True]
    for ids, shown in [((1, 2, 5), 5), ((-1, 2, 3), 3)]:  # three ids: the largest is the last, not the second
        with pytest.raises(ConfigError) as refused:
            AllowList(ids)(None, z)
        assert str(refused.value) == f"--allow {shown}: token id out of range [0, 5)"


# --- mutation run of core/methods/sample.py (2026-12-01, helper mutsam): validate_sample at each bound ------------


@pytest.mark.parametrize("fields, message", [
    ({"stop_id": (3, -1)}, "--stop-id -1: must be a token id >= 0"),  # the second id checked too
    ({"max_new_tokens": 0}, "--max-new-tokens 0: must be >= 1"),
    ({"top": -1}, "--top -1: must be >= 0"),
    ({"seed": -1}, "--seed -1: must be an integer in [0, 2**64)"),
    ({"seed": 2**64}, "--seed 18446744073709551616: must be an integer in [0, 2**64)"),
    ({"stop": ("END", "")}, "--stop '': an empty stop string matches everywhere; give some text"),
    ({"stop": ("ok", "a\udcff")}, "--stop 'a\\\\udcff': not valid UTF-8 (an undecodable byte at character 1); "
                                  "give UTF-8 text"),
    ({"compile": True}, "--cache full: --compile needs the cache to be compiled, which full cannot; policies that "
                        "can: static"),
    ({"temperature": -1.0}, "--temperature -1.0: must be >= 0 (0 means greedy)"),  # the chain's own checks run
])
def test_validate_sample_refuses_just_past_each_bound_with_its_exact_message(fields, message):
    with pytest.raises(ConfigError) as err:
        validate_sample(SampleSettings(**fields))
    assert str(err.value) == message


def test_validate_sample_accepts_each_bound_itself():
    """The smallest (and largest) value each check allows: stop id 0, one new token, top 0, seeds 0 and 2**64 - 1,
    a one-character stop string, --compile with the static cache."""
    for fields in [{"stop_id": (0,)}, {"max_new_tokens": 1}, {"top": 0}, {"seed": 0}, {"seed": 2**64 - 1},
                   {"stop": ("x",)}, {"compile": True, "cache": "static"}]:
        validate_sample(SampleSettings(**fields))


# --- mutation run of core/settings.py (2026-12-02): each helper of the settings module, messages word for word ----


def test_option_name_and_check_name_the_option_as_typed():
    from decodelab.core.settings import _check, option_name

    assert option_name("top_p") == "--top-p" and option_name("dry_penalty_last_n") == "--dry-penalty-last-n"
    _check(True, "top_p", 2, "must be in (0, 1]")
    with pytest.raises(ConfigError) as exc:
        _check(False, "top_p", 2, "must be in (0, 1]")
    assert str(exc.value) == "--top-p 2: must be in (0, 1]"


def test_parse_logit_bias_reads_texts_pairs_and_tables():
    from decodelab.core.settings import parse_logit_bias

    inf = float("inf")
    assert parse_logit_bias({"a": 1.5, "7": "-inf"}) == (("a", 1.5), ("7", -inf))
    assert parse_logit_bias([("x", 2), ["y", "3"]]) == (("x", 2.0), ("y", 3.0))
    assert parse_logit_bias(["a=b=2", " the=-1"]) == (("a=b", 2.0), (" the", -1.0))  # the last '=' splits
    with pytest.raises(ConfigError) as exc:
        parse_logit_bias([("x", "z")])
    assert str(exc.value) == "--logit-bias 'x'= 'z': expected float, a number in ASCII digits (e.g. 0.5 or 1e-3)"
    for item in ("=2", "abc"):
        with pytest.raises(ConfigError) as exc:
            parse_logit_bias([item])
        assert str(exc.value) == f"--logit-bias {item!r}: expected TOKEN=BIAS, e.g. 42=-inf or ' the'=2.5"
    with pytest.raises(ConfigError) as exc:
        parse_logit_bias([("a", "b", "c")])  # not a pair: read as text, which has no '='
    assert str(exc.value).startswith("--logit-bias ('a', 'b', 'c'): expected TOKEN=BIAS")
    with pytest.raises(ConfigError) as exc:
        parse_logit_bias(["a=x"], "--sequence-bias")
    assert str(exc.value) == "--sequence-bias 'a=x': BIAS 'x' is not a number (use -inf to ban)"


def test_coerce_reads_booleans_integers_floats_and_other_types():
    from decodelab.core.settings import _scalar

    for text in ("true", " TRUE ", "1", "yes", "on"):
        assert coerce(SampleSettings, "ignore_eos", text) is True
    for text in ("false", "0", "no", " No "):
        assert coerce(SampleSettings, "ignore_eos", text) is False
    assert _scalar(bool, "ignore_eos", "off") is False  # coerce reads "off" as None first
    assert coerce(SampleSettings, "ignore_eos", True) is True and coerce(SampleSettings, "ignore_eos", False) is False
    with pytest.raises(ConfigError) as exc:
        coerce(SampleSettings, "ignore_eos", "maybe")
    assert str(exc.value) == "--ignore-eos 'maybe': expected true or false"
    value = coerce(SampleSettings, "top_k", 5.0)  # TOML 5.0 for 5
    assert value == 5 and type(value) is int
    assert coerce(SampleSettings, "seed", -(2.0**62)) == -(2**62) and coerce(SampleSettings, "top_k", " 12") == 12
    for raw in (5.5, 2.0**63, -(2.0**63)):  # not an integer, or past the int64 range: refused, not rounded
        with pytest.raises(ConfigError) as exc:
            coerce(SampleSettings, "seed", raw)
        assert str(exc.value) == f"--seed {raw!r}: expected an integer"
    with pytest.raises(ConfigError) as exc:
        coerce(SampleSettings, "max_new_tokens", "1.5")
    assert str(exc.value) == "--max-new-tokens '1.5': expected int, an integer in ASCII digits 0-9"
    assert coerce(SampleSettings, "top_p", "0.5") == 0.5 and coerce(SampleSettings, "temperature", 2) == 2.0
    with pytest.raises(ConfigError) as exc:
        coerce(SampleSettings, "top_p", "x")
    assert str(exc.value) == "--top-p 'x': expected float, a number in ASCII digits (e.g. 0.5 or 1e-3)"
    assert coerce(SampleSettings, "cache", "window:size=8") == "window:size=8"
    assert _scalar(complex, "when", "1+2j") == 1 + 2j
    with pytest.raises(ConfigError) as exc:
        _scalar(complex, "when", "x")
    assert str(exc.value) == "--when 'x': expected complex"
    with pytest.raises(ConfigError) as exc:
        _scalar(complex, "when", [1])
    assert str(exc.value) == "--when [1]: expected complex"


def test_coerce_switches_off_lists_and_ids():
    for raw in (None, "none", " Off ", "NONE"):
        assert coerce(SampleSettings, "top_k", raw) is None
    assert coerce(SampleSettings, "top_k", 0) == 0
    for raw in (None, "off"):
        with pytest.raises(ConfigError) as exc:
            coerce(SampleSettings, "max_new_tokens", raw)
        assert str(exc.value) == "--max-new-tokens: cannot be switched off"
    assert coerce(SampleSettings, "logit_bias", "a=1,,b=2") == (("a", 1.0), ("b", 2.0))
    assert coerce(SampleSettings, "logit_bias", ["a=1"]) == (("a", 1.0),)
    assert coerce(SampleSettings, "sequence_bias", {"x y": -2}) == (("x y", -2.0),)
    with pytest.raises(ConfigError) as exc:
        coerce(SampleSettings, "sequence_bias", "x")
    assert str(exc.value) == "--sequence-bias 'x': expected TOKEN=BIAS, e.g. 42=-inf or ' the'=2.5"
    assert coerce(SampleSettings, "stop_id", " 3, 7,") == (3, 7)
    assert coerce(SampleSettings, "stop_id", [3, "7"]) == (3, 7) and coerce(SampleSettings, "stop_id", 5) == (5,)
    with pytest.raises(ConfigError) as exc:
        coerce(SampleSettings, "stop_id", "3,x")
    assert str(exc.value) == "--stop-id 'x': expected int, an integer in ASCII digits 0-9"
    assert coerce(SampleSettings, "dry_breaker", ["\n", "", ":"]) == ("\n", ":")  # a TOML list: kept as written
    assert coerce(SampleSettings, "stop", " a , ,b ") == ("a", "b")
    assert coerce(SampleSettings, "chain", "top_k, temperature") == ("top_k", "temperature")  # tuple | None
    assert coerce(SampleSettings, "chain", ["top_k"]) == ("top_k",)


def test_normalize_key_and_the_bundled_presets():
    import dataclasses

    from decodelab.core.settings import bundled_presets, field_names, load_preset, normalize_key, preset_dir

    names = [f.name for f in dataclasses.fields(SampleSettings)]
    assert field_names(SampleSettings) == names
    assert normalize_key(SampleSettings, " top-p ") == "top_p" and normalize_key(SampleSettings, "seed") == "seed"
    with pytest.raises(ConfigError) as exc:
        normalize_key(SampleSettings, "nope")
    assert str(exc.value) == f"unknown setting 'nope'; allowed: {', '.join(names)}"
    assert (preset_dir() / "greedy.toml").is_file()
    presets = bundled_presets()
    assert list(presets) == ["balanced", "creative", "greedy", "nucleus", "softcap"]
    assert all(path.name == f"{name}.toml" and path.is_file() for name, path in presets.items())
    name, table = load_preset("greedy")
    assert name == "greedy" and table["temperature"] == 0.0 and set(table) == {"description", "temperature"}
    with pytest.raises(ConfigError) as exc:
        load_preset("nope")
    assert str(exc.value) == ("--preset 'nope': not a bundled preset (balanced, creative, greedy, nucleus, softcap) "
                              "nor a .toml file")


def test_load_preset_reads_a_file_and_names_it_as_typed(tmp_path, monkeypatch):
    from decodelab.core.settings import load_preset

    (tmp_path / "mine.toml").write_text("top_k = 3\n")
    assert load_preset(str(tmp_path / "mine.toml")) == ("mine", {"top_k": 3})
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_preset("~/mine.toml") == ("mine", {"top_k": 3})
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff = 1\n")
    with pytest.raises(ConfigError) as exc:
        load_preset(str(bad))
    assert str(exc.value) == f"--preset {str(bad)!r}: not UTF-8 text (byte 0); TOML files are UTF-8"
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * 2**20)  # 1 MiB exactly: read
    assert load_preset(str(big)) == ("big", {})
    big.write_bytes(b"#" * (2**20 + 1))
    with pytest.raises(ConfigError) as exc:
        load_preset(str(big))
    assert str(exc.value) == (f"--preset {str(big)!r}: more than 1048576 bytes (1 MiB), the most decodelab reads; "
                              "give a shorter text")
    bad.write_text("top_k = \n")
    with pytest.raises(ConfigError) as exc:
        load_preset(str(bad))
    assert str(exc.value).startswith(f"--preset {str(bad)!r}: invalid TOML: ")


def test_resolve_layers_defaults_preset_options_and_sets(tmp_path):
    import dataclasses

    from decodelab.core.settings import as_dict, resolve

    assert resolve(SampleSettings) == SampleSettings()
    path = tmp_path / "p.toml"
    path.write_text('description = "mine"\ntop_k = 3\nseed = 4\ntop_p = 0.5\n')
    s = resolve(SampleSettings, str(path), {"top_k": None, "stop": (), "seed": 0, "top_p": 0.25},
                ["top-p = 0.75 ", "logit_bias=a=1"])
    assert type(s) is SampleSettings
    assert (s.top_k, s.seed, s.stop, s.top_p, s.logit_bias) == (3, 0, (), 0.75, (("a", 1.0),))
    assert resolve(SampleSettings, None, {"ignore_eos": False, "max_new_tokens": 9}).max_new_tokens == 9
    with pytest.raises(ConfigError) as exc:
        resolve(SampleSettings, None, None, ["seed"])
    assert str(exc.value) == "--set 'seed': expected KEY=VALUE"
    with pytest.raises(ConfigError) as exc:
        resolve(SampleSettings, None, None, ["seed=x"])
    assert str(exc.value) == "--seed 'x': expected int, an integer in ASCII digits 0-9"
    path.write_text("nope = 1\n")
    with pytest.raises(ConfigError) as exc:
        resolve(SampleSettings, str(path))
    names = ", ".join(f.name for f in dataclasses.fields(SampleSettings))
    assert str(exc.value) == f"--preset {str(path)!r}: key 'nope' in the file: unknown setting 'nope'; allowed: {names}"
    path.write_text('top-k = "x"\n')
    with pytest.raises(ConfigError) as exc:
        resolve(SampleSettings, str(path))
    assert str(exc.value) == (f"--preset {str(path)!r}: key 'top-k' in the file: --top-k 'x': expected int, an "
                              "integer in ASCII digits 0-9")
    d = as_dict(SampleSettings(logit_bias=(("a", 1.0), ("7", -2.0)), sequence_bias=(("b c", -2.0),), seed=3))
    assert d["logit_bias"] == {"a": 1.0, "7": -2.0} and d["sequence_bias"] == {"b c": -2.0} and d["seed"] == 3
    assert d["stop"] == () and d["top_k"] is None

    @dataclasses.dataclass(frozen=True)
    class OnlyLogitBias:  # a method's settings without sequence_bias: no such key is added
        logit_bias: PAIRS = (("b", 0.5),)  # a pair-valued setting is known by its type

    assert as_dict(OnlyLogitBias()) == {"logit_bias": {"b": 0.5}}

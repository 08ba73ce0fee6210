"""The trace page in a real browser: headless Chromium (the system's package) driven by Selenium with the system
chromedriver. Pages are made from real traces of each command; the tests hover and click through them and check
that the numbers shown are the JSON's, that the branch command shown reruns the run with the forced token, that the
page asks for nothing outside its file, and that it works from the keyboard, without colour, at phone width and on
a 4,000-token trace.

Marked `browser` (left out of the default run; `.ci/run` runs them): `pytest -m browser`. Needs
`apt-get install chromium chromium-driver` and `pip install -e '.[browser]'`; skipped, saying so, without them."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import shutil
import time

import pytest
from conftest import ROOT

from decodelab.cli.view.html import write_page

pytestmark = pytest.mark.browser

RECORDING = ROOT / "tests" / "engine" / "recordings" / "vllm-0.32.0.json"
RUNS = {
    "sample": ["sample", "Once upon a time", "-n", "8", "-t", "0.9", "--top-p", "0.95", "--top", "4", "--seed", "3"],
    "greedy": ["sample", "Once upon a time", "-n", "4", "-t", "0", "--top", "3"],
    "score": ["score", "Once upon a time there was a little girl"],
    "stream": ["stream", "Once upon", "-n", "6", "--cache", "sinks:sinks=1,recent=3", "-t", "0.7", "--top", "2"],
    "beam": ["beam", "Once upon", "-n", "4", "-b", "2", "--sweep-length-penalty", "0,1,4"],
    "speculate": ["speculate", "Once upon", "-n", "8", "-t", "0.9", "--draft", "tiny-draft"],
    "compare": ["compare", "Once upon", "-V", "g: temperature=0", "-V", "h: temperature=0.9,top_k=5",
                "-V", "b: method=beam,beams=2", "-n", "4"],
    "probs": ["probs", "Once upon", "-t", "0.7", "--top-k", "5"],
    "models": ["models"],
}


def chromium() -> tuple[str, str]:
    browser = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("no Chromium or chromedriver: apt-get install -y chromium chromium-driver")
    return browser, driver


@pytest.fixture(scope="module")
def driver():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium missing: pip install -e '.[browser]'")
    from selenium.webdriver.chrome.service import Service

    browser, driver_path = chromium()
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900",
                "--disable-background-networking", "--no-first-run"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    d = webdriver.Chrome(service=Service(driver_path), options=opts)
    yield d
    d.quit()


def run(args: list[str]) -> dict:
    from decodelab.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args + ["-f", "json", "--threads", "1"] if args[0] != "models" else args + ["-f", "json"])
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("traces")
    prompts = folder / "prompts.txt"
    prompts.write_text("Once upon a time\nOnce upon a hill\nThe cat\n", encoding="utf-8")
    docs = {name: run(args) for name, args in RUNS.items()}
    docs["batch"] = run(["batch", "--prompts-file", str(prompts), "-n", "4", "--max-batch", "2"])
    call = json.loads(RECORDING.read_text(encoding="utf-8"))["modes"]["raw_logprobs"][28]  # vLLM, echo, text keys
    docs["openai"] = json.loads(call["response"])
    return docs


def open_page(d, tmp_path, doc, name="page") -> None:
    path = write_page(doc, tmp_path / f"{name}.html")
    d.get_log("performance")  # drop earlier pages' events
    d.get(path.as_uri())
    for _ in range(200):
        if d.execute_script("return window.decodelabPage !== undefined"):
            break
        time.sleep(0.02)
    assert d.execute_script("return window.decodelabError || null") is None
    severe = [e for e in d.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe
    requested = [json.loads(e["message"])["message"] for e in d.get_log("performance")]
    urls = {m["params"]["request"]["url"] for m in requested if m["method"] == "Network.requestWillBeSent"}
    assert urls <= {path.as_uri()}, f"the page asked for something outside its file: {urls - {path.as_uri()}}"
    assert d.execute_script("return performance.getEntriesByType('resource').length") == 0


def hover(d, element) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(d).move_to_element(element).perform()


def panel(d) -> dict:
    """The detail panel's values by JSON field (the first of each name outside the alternatives and stages
    tables), and its alternatives and stages rows."""
    return d.execute_script("""
        const p = document.getElementById('detail'), top = {};
        const rows = (sel) => [...p.querySelectorAll(sel)].map((tr) =>
            Object.fromEntries([...tr.querySelectorAll('td[data-f]')].map((td) => [td.dataset.f, td.textContent])));
        p.querySelectorAll('td[data-f]').forEach((td) => {
            if (!td.closest('tr[data-alt], tr[data-stage]') && !(td.dataset.f in top)) top[td.dataset.f] = td.textContent; });
        return {top, alts: rows('tr[data-alt]'), stages: rows('tr[data-stage]')};""")


def same(shown: str, value) -> bool:
    """A value shown equals the JSON's: numbers exactly (the shortest text that reads back as the same double)."""
    if value is None:
        return shown == "null"
    if isinstance(value, bool):
        return shown == str(value).lower()
    if isinstance(value, (int, float)):
        return float(shown) == value
    if isinstance(value, (list, dict)):
        return json.loads(shown) == value
    return json.loads(shown) == value if shown.startswith('"') else shown == value


def assert_shown(shown: dict, record: dict, fields) -> None:
    for f in fields:
        assert f in shown, f"{f} not shown"
        assert same(shown[f], record[f]), (f, shown[f], record[f])


STEP_FIELDS = ("token", "token_id", "prob", "logprob", "raw_prob", "raw_logprob", "raw_rank", "entropy",
               "raw_entropy", "kept", "decided_by", "why")


def tokens(d):
    from selenium.webdriver.common.by import By

    return d.find_elements(By.CSS_SELECTOR, "#tokens .t")


def branch_commands(d) -> list[tuple[int, str]]:
    return d.execute_script("return [...document.querySelectorAll('#tokens .branch pre.cmd')]"
                            ".map((p) => [+p.dataset.tokenId, p.textContent])")


def rerun(command: str) -> dict:
    argv = shlex.split(command)  # what a shell makes of the text shown: the quoting is checked too
    assert argv[:2] == ["decodelab", "sample"]
    return run(argv[1:])


# --- sample ---------------------------------------------------------------------------------------------------


def test_sample_hover_shows_each_step_as_the_json_has_it(driver, traces, tmp_path):
    doc = traces["sample"]
    open_page(driver, tmp_path, doc)
    spans = tokens(driver)
    assert len(spans) == len(doc["steps"])
    for span, step in zip(spans, doc["steps"]):
        hover(driver, span)
        shown = panel(driver)
        assert_shown(shown["top"], step, STEP_FIELDS)
        assert len(shown["alts"]) == len(step["alternatives"])
        for row, alt in zip(shown["alts"], step["alternatives"]):
            assert_shown(row, alt, ("token_id", "prob", "raw_prob"))
        assert len(shown["stages"]) == len(step["stages"])
        for row, stage in zip(shown["stages"], step["stages"]):
            assert_shown(row, stage, ("name", "kept", "entropy", "mass_removed"))
    classes = [s.get_attribute("class") for s in spans]
    shade = [next(i for i, low in enumerate((0.5, 0.1, 0.01, 0.0)) if s["prob"] >= low) for s in doc["steps"]]
    assert [f"s{k}" in c for c, k in zip(classes, shade)] == [True] * len(spans), "shaded by processed p"
    assert "processed p" in driver.find_element("css selector", "#tokens [data-legend]").text


def test_sample_click_gives_the_command_that_branches_there(driver, traces, tmp_path):
    doc = traces["sample"]
    open_page(driver, tmp_path, doc)
    k = 3
    tokens(driver)[k].click()
    commands = branch_commands(driver)
    step = doc["steps"][k]
    kept = [a for a in step["alternatives"] if a["prob"] > 0 and a["token_id"] != step["token_id"]]
    assert [t for t, _ in commands] == [step["token_id"]] + [a["token_id"] for a in kept]
    removed = driver.execute_script("return [...document.querySelectorAll('#tokens [data-removed]')].map((e) => +e.dataset.removed)")
    assert removed == [a["token_id"] for a in step["alternatives"] if not a["prob"] > 0], "refused tokens are said so"
    own = rerun(commands[0][1])
    assert own["token_ids"] == doc["token_ids"] and own["config"] == doc["config"], "the command reruns the trace"
    token, command = commands[1]
    branched = rerun(command)
    assert branched["token_ids"][:k] == doc["token_ids"][:k], "the steps before the branch are the trace's own"
    assert branched["steps"][k]["token_id"] == token and branched["steps"][k]["decided_by"] == "forced"


def test_greedy_shades_by_raw_and_says_why(driver, traces, tmp_path):
    doc = traces["greedy"]
    open_page(driver, tmp_path, doc)
    assert "raw p" in driver.find_element("css selector", "#tokens [data-legend]").text
    assert "greedy: every processed p is 1" in driver.find_element("id", "content").text
    driver.find_element("css selector", "#tokens button[data-mode=processed]").click()
    assert "processed p" in driver.find_element("css selector", "#tokens [data-legend]").text
    assert all("s0" in s.get_attribute("class") for s in tokens(driver)), "processed p 1 everywhere"


def test_a_greedy_batch_request_shades_by_raw_and_says_why(driver, tmp_path):
    """Issue 40: a greedy request's processed p is 1 at every step, so its text is shaded by raw p by default, with a
    note; a sampled request keeps the processed shading."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once upon a time", "temperature": 0}\n{"prompt": "The cat", "temperature": 0.9}\n',
                       encoding="utf-8")
    doc = run(["batch", "--prompts-file", str(prompts), "-n", "3"])
    open_page(driver, tmp_path, doc)
    pressed = [b.text for b in driver.find_elements("css selector", "[id^=request-] button[aria-pressed=true]")]
    assert pressed == ["raw p", "processed p"]
    (note,) = driver.find_elements("css selector", "#content [data-one-hot]")
    assert note.text.startswith(f"request {doc['requests'][0]['id']}: every processed p is 1 (greedy)")


def test_compare_says_which_prompt_ran_with_its_own_settings(driver, tmp_path):
    """Issue 40: a --prompts-file line's own settings override every variant's for that prompt; its block says so."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "x", "prompt": "Hello"}\n{"prompt": "Once", "temperature": 0.7}\n', encoding="utf-8")
    doc = run(["compare", "--prompts-file", str(prompts), "-V", "a: temperature=0", "-V", "b: temperature=1.2", "-n", "3"])
    open_page(driver, tmp_path, doc)
    (note,) = driver.find_elements("css selector", "#content [data-own-settings]")
    assert note.text.endswith('{"temperature":0.7}')


def test_greedy_shows_the_raw_distribution_labelled_raw(driver, traces, tmp_path):
    """Issue 40: greedy's processed distribution is one-hot; as the terminal's list marked raw:, the page shows each
    step's raw p and its alternatives' raw p (section #raw-one-hot), and a step's panel lists the raw p first."""
    doc = traces["greedy"]
    open_page(driver, tmp_path, doc)
    section = driver.find_element("id", "raw-one-hot")
    cells = section.find_elements("css selector", "td[data-f=raw_prob] .n")
    assert [float(c.get_attribute("data-v")) for c in cells] == [s["raw_prob"] for s in doc["steps"]]
    assert "raw: " in section.text
    hover(driver, tokens(driver)[1])
    shown = panel(driver)
    assert driver.find_element("css selector", "#detail [data-one-hot]").text.startswith("raw: ")
    assert_shown(shown["alts"][1], doc["steps"][1]["alternatives"][1], ("token_id", "prob", "raw_prob"))


def test_the_keyboard_reaches_and_walks_the_tokens(driver, traces, tmp_path):
    from selenium.webdriver.common.keys import Keys

    doc = traces["sample"]
    open_page(driver, tmp_path, doc)
    body = driver.find_element("tag name", "body")
    for _ in range(20):
        body.send_keys(Keys.TAB) if _ == 0 else driver.switch_to.active_element.send_keys(Keys.TAB)
        if "t" in (driver.switch_to.active_element.get_attribute("class") or "").split():
            break
    active = driver.switch_to.active_element
    assert active.get_attribute("data-i") == "0", "one Tab stop leads into the tokens, at the first"
    active.send_keys(Keys.ARROW_RIGHT, Keys.ARROW_RIGHT)
    assert driver.switch_to.active_element.get_attribute("data-i") == "2"
    assert same(panel(driver)["top"]["token_id"], doc["steps"][2]["token_id"]), "focus shows the step's numbers"
    driver.switch_to.active_element.send_keys(Keys.END)
    last = len(doc["steps"]) - 1
    assert driver.switch_to.active_element.get_attribute("data-i") == str(last)
    driver.switch_to.active_element.send_keys(Keys.ENTER)
    assert branch_commands(driver)[0][1].endswith(f"--force {last}={doc['steps'][last]['token_id']}")
    assert driver.execute_script("return [...document.querySelectorAll('#tokens .t')].filter((e) => e.tabIndex === 0).length") == 1


def test_readable_without_colour(driver, traces, tmp_path):
    open_page(driver, tmp_path, traces["sample"])
    driver.find_element("id", "nocolor").click()
    style = driver.execute_script("""
        const out = {};
        for (const k of [0, 1, 2, 3]) {
            const e = document.createElement('span'); e.className = 't s' + k; e.textContent = 'x';
            document.getElementById('tokens').appendChild(e); const c = getComputedStyle(e);
            out[k] = [c.backgroundColor, c.fontStyle, c.textDecorationLine, c.fontWeight]; e.remove(); }
        return out;""")
    assert all(v[0] == "rgba(0, 0, 0, 0)" for v in style.values()), "no colour left"
    assert style["0"][1:] == ["normal", "none", "400"]
    assert style["1"][1] == "italic" and style["2"][2] == "underline"
    assert style["3"][2] == "underline" and style["3"][3] == "700", "each class keeps its own attribute"


def test_fine_at_phone_width(driver, traces, tmp_path):
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {"width": 390, "height": 844, "deviceScaleFactor": 2,
                                                                   "mobile": True})
    try:
        for name in ("sample", "beam", "batch", "compare"):
            open_page(driver, tmp_path, traces[name], name)
            width = driver.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")
            assert width[0] <= width[1], f"{name}: the page scrolls sideways at phone width {width}"
        open_page(driver, tmp_path, traces["sample"])
        tokens(driver)[1].click()
        box = driver.execute_script("const r = document.getElementById('detail').getBoundingClientRect();"
                                    "return [r.top, r.bottom, r.width, window.innerHeight, window.innerWidth]")
        assert box[1] <= box[3] + 1 and box[2] >= box[4] - 1, "the panel sits on screen, full width, at the bottom"
        assert same(panel(driver)["top"]["token_id"], traces["sample"]["steps"][1]["token_id"])
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_quick_on_a_4000_token_trace(driver, traces, tmp_path, record_property):
    """A trace of 4,000 steps (real step records of a sample run, repeated and renumbered: the tiny model's context
    is 512): the page draws in well under a second on a quiet machine; asserted under 5 s, measured and recorded."""
    doc = json.loads(json.dumps(traces["sample"]))
    base = doc["steps"]
    doc["steps"] = [{**base[i % len(base)], "index": i, "position": len(doc["prompt"]["token_ids"]) + i}
                    for i in range(4000)]
    doc["token_ids"] = [s["token_id"] for s in doc["steps"]]
    open_page(driver, tmp_path, doc, "long")
    timing = driver.execute_script("const n = performance.getEntriesByType('navigation')[0];"
                                   "return [n.domContentLoadedEventEnd, n.loadEventEnd, window.decodelabPage.drawnMs]")
    record_property("load_ms", timing[1])
    record_property("draw_ms", timing[2])
    print(f"4,000 tokens: DOMContentLoaded {timing[0]:.0f} ms, load {timing[1]:.0f} ms, drawn in {timing[2]:.0f} ms")
    assert timing[1] < 5000 and timing[2] < 3000, timing
    spans = tokens(driver)
    assert len(spans) == 4000
    start = time.perf_counter()
    hover(driver, spans[3999])
    assert same(panel(driver)["top"]["token_id"], doc["steps"][3999]["token_id"])
    assert "step 3999" in driver.find_element("id", "detail").text
    assert time.perf_counter() - start < 2


# --- the other views ------------------------------------------------------------------------------------------


def test_score_shows_each_scored_token_and_branches_from_the_text_before_it(driver, traces, tmp_path):
    doc = traces["score"]
    open_page(driver, tmp_path, doc)
    spans = tokens(driver)
    assert len(spans) == len(doc["steps"])
    for span, step in zip(spans, doc["steps"]):
        hover(driver, span)
        assert_shown(panel(driver)["top"], step, ("token", "token_id", "raw_logprob", "raw_rank", "raw_entropy",
                                                   "logprob"))
    assert "exp(raw_logprob)" in driver.find_element("css selector", "#tokens [data-legend]").text
    k = 4
    spans[k].click()
    (token, command), = branch_commands(driver)
    step = doc["steps"][k]
    branched = rerun(command)
    assert branched["prompt"]["token_ids"] == doc["prompt"]["token_ids"][:step["position"]], "the same context ids"
    assert branched["steps"][0]["token_id"] == token == step["token_id"]
    assert branched["steps"][0]["raw_logprob"] == pytest.approx(step["raw_logprob"], abs=1e-5), \
        "step 0 of the branch has this position's numbers"


def test_stream_shows_the_slot_map_and_branches_with_its_cache(driver, traces, tmp_path):
    doc = traces["stream"]
    open_page(driver, tmp_path, doc)
    spans = tokens(driver)
    for span, step in zip(spans, doc["steps"]):
        hover(driver, span)
        assert_shown(panel(driver)["top"], step, STEP_FIELDS + ("cache_tokens", "kv_bytes", "evicted", "slots"))
    runs = driver.execute_script("return document.querySelectorAll('svg.slots rect.run').length")
    assert runs == sum(len(s["slots"]) for s in doc["steps"])
    spans[2].click()
    token, command = branch_commands(driver)[1]
    assert "--cache sinks:sinks=1,recent=3" in command
    branched = rerun(command)
    assert branched["token_ids"][:2] == doc["token_ids"][:2] and branched["steps"][2]["token_id"] == token


def test_beam_tree_nodes_hypotheses_and_sweep(driver, traces, tmp_path):
    from selenium.webdriver.common.by import By

    doc = traces["beam"]
    open_page(driver, tmp_path, doc)
    nodes = driver.find_elements(By.CSS_SELECTOR, "svg.tree g.node")
    candidates = [c for s in doc["steps"] for c in sorted(s["candidates"], key=lambda c: c["rank"])]
    assert len(nodes) == len(candidates)
    for node, cand in zip(nodes, candidates):
        hover(driver, node)
        assert_shown(panel(driver)["top"], cand, ("rank", "parent", "token_id", "token", "logprob", "raw_logprob",
                                                   "sum_logprob", "score", "finishes", "fate"))
        assert cand["fate"] in node.get_attribute("class")
    driver.find_element("id", "exact").click()
    rows = driver.execute_script("""return [...document.querySelectorAll('section')].find((s) =>
        s.querySelector('h2').textContent === 'finished hypotheses').querySelectorAll('tbody tr').length""")
    assert rows == len(doc["hypotheses"])
    shown = driver.execute_script("""const s = [...document.querySelectorAll('section')].find((s) =>
        s.querySelector('h2').textContent === 'finished hypotheses');
        return [...s.querySelectorAll('tbody tr')].map((tr) => Object.fromEntries([...tr.querySelectorAll('td')]
            .map((td) => [td.dataset.f, td.innerText])));""")
    for row, hyp in zip(shown, doc["hypotheses"]):
        assert_shown(row, hyp, ("rank", "text", "length", "sum_logprob", "raw_sum_logprob", "score", "step", "reason"))
    marks = driver.execute_script("""const s = [...document.querySelectorAll('section')].find((s) =>
        s.querySelector('h2').textContent.startsWith('length-penalty sweep'));
        return [...s.querySelectorAll('tbody tr')].map((tr) => tr.classList.contains('mark'))""")
    assert marks == [row["changed"] for row in doc["sweep"]]


def test_speculate_rounds(driver, traces, tmp_path):
    from selenium.webdriver.common.by import By

    doc = traces["speculate"]
    open_page(driver, tmp_path, doc)
    chips = driver.find_elements(By.CSS_SELECTOR, "table.rounds .chip")
    expected = []
    for r in doc["steps"]:
        expected += [("proposed", r, p) for p in r["proposed"]]
        extra = r.get("correction") or r.get("bonus") or r.get("plain")
        if extra:
            expected.append(("extra", r, extra))
    assert len(chips) == len(expected)
    assert any(p["accepted"] for k, _, p in expected if k == "proposed"), "the trace has accepted drafts"
    assert any(not p["accepted"] and p["reached"] for k, _, p in expected if k == "proposed"), "and rejections"
    for chip, (kind, r, rec) in zip(chips, expected):
        hover(driver, chip)
        shown = panel(driver)["top"]
        if kind == "proposed":
            assert_shown(shown, rec, ("token", "token_id", "q", "p", "u", "accept_prob", "accepted", "reached", "raw_q",
                                      "raw_p"))
            want = "unr" if not rec["reached"] else "acc" if rec["accepted"] else "rej"
            assert want in chip.get_attribute("class").split()
        else:
            assert_shown(shown, rec, ("kind", "token", "token_id", "prob", "p", "raw_p", "emitted"))


def test_compare_marks_the_first_divergence_and_its_deciding_stage(driver, traces, tmp_path):
    doc = traces["compare"]
    open_page(driver, tmp_path, doc)
    ref = doc["rows"][0]
    pairs = [p for p in doc["pairs"] if p["a"] == ref["variant"]]
    lines = driver.execute_script("return [...document.querySelectorAll('ul.divergence li')].map((li) => li.textContent)")
    assert len(lines) == len(pairs)
    for line, p in zip(lines, pairs):
        assert f"step {p['first_divergence']}" in line and p["deciding_stage"] in line and p["why"] in line
    marked = driver.execute_script("return [...document.querySelectorAll('td.div')].map((td) => [+td.dataset.row, +td.dataset.j])")
    rows = {r["variant"]: i for i, r in enumerate(doc["rows"])}
    assert sorted(marked) == sorted([rows[p["b"]], p["first_divergence"]] for p in pairs)
    cells = driver.execute_script("return [...document.querySelectorAll('td[data-row]')].map((td) => [+td.dataset.row, +td.dataset.j, td.textContent.replace('◆', '')])")
    for row, j, text in cells:
        ids = doc["rows"][row]["token_ids"]
        assert text == (str(ids[j]) if j < len(ids) else "")


def test_batch_timeline(driver, traces, tmp_path):
    doc = traces["batch"]
    open_page(driver, tmp_path, doc)
    assert "differs from the JSON" not in driver.find_element("id", "content").text, \
        "the derived running counts equal each iteration's `running`"
    grid = driver.execute_script("return [...document.querySelectorAll('table.timeline tr')].slice(1)"
                                 ".map((tr) => [...tr.querySelectorAll('td')].map((td) => td.textContent))")
    for cells, req in zip(grid, doc["requests"]):
        assert cells[req["joined"]] == "J"
        assert cells[req["finished"]] == ("F" if req["finished"] != req["joined"] else "J")
        assert all(c == "" for c in cells[req["finished"] + 1:]), "nothing after it finished"
    from selenium.webdriver.common.by import By

    headers = driver.find_elements(By.CSS_SELECTOR, "table.timeline th.itcol")
    for th, it in zip(headers, doc["iterations"]):
        hover(driver, th)
        assert_shown(panel(driver)["top"], it, ("index", "running", "rows", "joined", "finished", "waiting",
                                                 "blocks_used", "prefix_hit_tokens", "tokens", "seconds"))


def test_probs_tables_hold_the_json_numbers(driver, traces, tmp_path):
    doc = traces["probs"]
    open_page(driver, tmp_path, doc)
    driver.find_element("id", "exact").click()
    rows = driver.execute_script("""const s = [...document.querySelectorAll('section')].find((s) =>
        s.querySelector('h2').textContent === 'tokens through the stages');
        return [...s.querySelectorAll('tbody tr')].map((tr) => Object.fromEntries([...tr.querySelectorAll('td')]
            .map((td) => [td.dataset.f, td.innerText])));""")
    assert len(rows) == len(doc["tokens"])
    for row, t in zip(rows, doc["tokens"]):
        assert_shown(row, t, ("token", "token_id", "logit", "raw_prob"))
        for stage, p in t["probs"].items():
            assert same(row[f"p:{stage}"], p) and same(row[f"rank:{stage}"], t["ranks"][stage])


def test_an_engine_response_in_the_openai_format(driver, traces, tmp_path):
    doc = traces["openai"]
    open_page(driver, tmp_path, doc)
    lp = doc["choices"][0]["logprobs"]
    from selenium.webdriver.common.by import By

    spans = driver.find_elements(By.CSS_SELECTOR, "#choice-0 .t")
    assert len(spans) == len(lp["tokens"])
    for i, span in enumerate(spans):
        hover(driver, span)
        shown = panel(driver)
        assert same(shown["top"]["token"], lp["tokens"][i]) and same(shown["top"]["token_logprob"], lp["token_logprobs"][i])
        assert same(shown["top"]["text_offset"], lp["text_offset"][i])
        top = lp["top_logprobs"][i] or {}
        assert [same(r["logprob"], v) for r, v in zip(shown["alts"], top.values())] == [True] * len(top)
    assert "no branch command" in driver.find_element("id", "content").text


def test_a_document_without_a_view_of_its_own(driver, traces, tmp_path):
    open_page(driver, tmp_path, traces["models"])
    assert "tiny" in driver.find_element("id", "content").text


# --- a thinking model's run (issue 39) ------------------------------------------------------------------------


def test_a_thinking_run_shows_its_reasoning_and_answer_apart(driver, tmp_path):
    """The page draws the run's split: one label per generated token, as the JSON's parts, where the answer starts,
    and the per-part summary; a run without markers has no such section."""
    from selenium.webdriver.common.by import By

    doc = run(["sample", "Q?<think>", "-n", "8", "-t", "0", "--think-tags", "<think>,</think>",
               "--thinking-budget", "2"])
    open_page(driver, tmp_path, doc)
    section = driver.find_element("id", "reasoning")
    labels = [e.get_attribute("data-part") for e in section.find_elements(By.CSS_SELECTOR, ".parts span")]
    assert labels == doc["reasoning"]["parts"] and "reasoning" in labels and "answer" in labels
    assert f"answer starts at generated token {doc['reasoning']['answer_starts_at']}" in section.text
    assert len(section.find_elements(By.CSS_SELECTOR, "table tbody tr")) == len(doc["reasoning"]["summary"])
    plain = run(["sample", "Once upon", "-n", "3", "-t", "0"])
    open_page(driver, tmp_path, plain, "plain")
    assert not driver.find_elements("id", "reasoning")

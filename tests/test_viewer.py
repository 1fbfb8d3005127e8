# The run page (trainer/viewer.py) in a real headless browser (Debian's chromium and chromium-driver, driven by selenium;
# nothing is downloaded): every token of a row is one element, hovering one shows its record, a sealed rollout shows
# its seal, nothing on the page raises, and no string a model, a tool, an agent or a request wrote becomes markup or
# stops the page's own script (breakers in every place one can stand, on a run's page and a session's). One tiny
# real run serves the module, logged to a wandb offline run too, whose history is read back from its own
# transaction log and must equal metrics.jsonl.
import glob
import json
import os
import struct
import subprocess
import sys
import tempfile
import urllib.request

import openai
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.support.ui import Select
from wandb.proto import wandb_internal_pb2

import data
import models
from loopback import LoopbackServer
from rollout import EmbeddedEngine
from trainer import viewer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_RUN = ["--recipe", "math", "--model", "tiny-qwen3", "--rollout.prompts_per_step", "2",
            "--rollout.samples_per_prompt", "2", "--rollout.max_tokens", "6", "--run.threads", "1", "--steps", "2"]
# chromium as root on a machine without network: no sandbox, and nothing that phones home (it stalls otherwise)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,1000"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("run") / "out")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    done = subprocess.run([sys.executable, "train.py", *TINY_RUN, "--out", out, "--run.wandb", "tracerl-test"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    view = subprocess.run([sys.executable, "train.py", "view", out], cwd=ROOT, capture_output=True, text=True)
    assert view.returncode == 0 and "view.html" in view.stdout, view.stderr
    return out


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in CHROMIUM_FLAGS + [f"--user-data-dir={tempfile.mkdtemp()}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    yield driver
    driver.quit()


def open_page(browser, path: str) -> None:
    browser.get("file://" + os.path.abspath(path))
    browser.get_log("browser")                 # only what this page logs from here on counts


def js_errors(browser) -> list[dict]:
    return [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


def traced_rows(out: str) -> list[dict]:
    rows = []
    for name in sorted(os.listdir(os.path.join(out, "traces"))):
        rows += [json.loads(line) for line in open(os.path.join(out, "traces", name))]
    return rows


def test_every_token_of_every_traced_row_is_one_element_of_the_page(run, browser):
    open_page(browser, os.path.join(run, "view.html"))
    Select(browser.find_element("id", "step")).select_by_value("all")
    rows = traced_rows(run)
    cards = browser.find_elements("css selector", "#rows .row")
    assert len(cards) == len(rows) == 8              # 4 rows per step, 2 steps
    for card in cards:
        row = rows[int(card.get_attribute("data-index"))]
        tokens = card.find_elements("css selector", ".tok")
        assert len(tokens) == len(row["token_ids"])
        sampled = [t for t, why in enumerate(row["mask_reason"]) if why != "context"]
        assert "".join(tokens[t].get_attribute("textContent") for t in sampled) == "".join(row["text"][t] for t in sampled)
    assert js_errors(browser) == []


def test_hovering_a_token_shows_its_logprobs_and_advantage(run, browser):
    open_page(browser, os.path.join(run, "view.html"))
    card = browser.find_element("css selector", "#rows .row")
    row = traced_rows(run)[int(card.get_attribute("data-index"))]
    t = next(t for t, why in enumerate(row["mask_reason"]) if why != "context")
    token = card.find_elements("css selector", ".tok")[t]
    ActionChains(browser).move_to_element(token).perform()
    shown = {name: float(browser.find_element("css selector", f"#record .f-{name}").text)
             for name in ("behavior_logprob", "trainer_logprob", "advantage", "IS_weight")}
    assert shown["behavior_logprob"] == pytest.approx(row["behavior_logprob"][t], abs=1e-4)
    assert shown["trainer_logprob"] == pytest.approx(row["trainer_logprob"][t], abs=1e-4)
    assert shown["advantage"] == pytest.approx(row["advantage"][t], abs=1e-4)
    assert shown["IS_weight"] == pytest.approx(row["is_weight"][t], abs=1e-4)
    assert browser.find_element("css selector", "#record .f-id").text == str(row["token_ids"][t])
    assert js_errors(browser) == []


def test_every_colouring_filter_and_sort_draws_without_a_javascript_error(run, browser):
    open_page(browser, os.path.join(run, "view.html"))
    for select_id in ("colour", "show", "sort", "step"):
        select = Select(browser.find_element("id", select_id))
        for option in [o.get_attribute("value") for o in select.options]:
            select.select_by_value(option)
    browser.find_element("id", "hide-context").click()
    Select(browser.find_element("id", "more")).select_by_index(1)       # add a curve
    assert js_errors(browser) == []
    # the check sees errors: a page that raises is caught by it
    browser.get("data:text/html,<script>undefined_function()</script>")
    assert js_errors(browser)


def test_the_page_needs_no_network(run):
    page = open(os.path.join(run, "view.html")).read()
    for fetch in ("<link", "src=\"http", "src='http", "@import", "url(http", "fetch(", "XMLHttpRequest"):
        assert fetch not in page


@pytest.fixture(scope="module")
def sealed_session(tmp_path_factory):
    """A loopback session whose second request edits the history (its first segment seals), and a side request (another
    system prompt: a line of its own)."""
    tok = models.bpe_tokenizer()
    server = LoopbackServer(EmbeddedEngine(models.tiny_model("qwen3", seed=1).eval(), tokenizer=tok), tok,
                            template=data.CHATML_TEMPLATE)
    server.start()
    info = server.create_session()
    client = openai.OpenAI(base_url=info.base_url, api_key=info.api_key, max_retries=0)
    first = client.chat.completions.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "one"}])
    client.chat.completions.create(model="m", max_tokens=5, messages=[
        {"role": "user", "content": "an edited first question"},
        {"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "two"}])
    client.chat.completions.create(model="m", max_tokens=5, messages=[
        {"role": "system", "content": "Name this session."}, {"role": "user", "content": "one"}])
    auth = {"Authorization": f"Bearer {info.api_key}"}
    with urllib.request.urlopen(urllib.request.Request(info.trace_url, headers=auth)) as response:
        trace = json.loads(response.read())
    with urllib.request.urlopen(urllib.request.Request(info.view_url, headers=auth)) as response:
        assert response.headers["Content-Type"].startswith("text/html")
        page = response.read().decode()
    server.stop()
    path = tmp_path_factory.mktemp("session") / "session.html"
    path.write_text(page)
    return str(path), trace


def test_a_sealed_rollout_shows_its_seal_on_the_session_page(sealed_session, browser):
    path, trace = sealed_session
    sealed = [s for s in trace["segments"] if s["seal_reason"]]
    assert len(trace["segments"]) == 3 and len(sealed) == 1
    open_page(browser, path)
    Select(browser.find_element("id", "show")).select_by_value("sealed")
    cards = browser.find_elements("css selector", "#rows .row")
    assert len(cards) == 2                          # the sealed segment and the one after the seal
    seal = cards[0].find_element("css selector", ".seal-note")
    assert sealed[0]["seal_reason"] in seal.text and "sealed" in seal.text
    assert f"first {sealed[0]['common_prefix_len']} tokens" in seal.text
    assert len(cards[0].find_elements("css selector", ".tok")) == len(sealed[0]["token_ids"])
    assert js_errors(browser) == []


def test_a_side_line_is_labelled_on_the_session_page(sealed_session, browser):
    path, trace = sealed_session
    assert [s["line"] for s in trace["segments"]] == ["main", "main", "side-1"]
    open_page(browser, path)
    badges = [[b.text for b in card.find_elements("css selector", ".badge")]
              for card in browser.find_elements("css selector", "#rows .row")]
    assert [card for card in badges if "side-1 line" in card] and sum("side-1 line" in b for b in badges) == 1
    assert js_errors(browser) == []


def test_tool_calls_and_results_are_labelled_in_model_turns_only():
    text = ["<|im_start|>", "system\nsay <tool_call></tool_call>", "<|im_end|>", "<|im_start|>", "assistant\n",
            "<tool_call>", "{}", "</tool_call>", "<|im_end|>", "<|im_start|>", "user\n<tool_response>", "4",
            "</tool_response>", "<|im_end|>"]
    roles, blocks = viewer.label_tokens(text)
    assert roles[1] == "system" and blocks[1] == ""                  # the system prompt's example of the format
    assert roles[5] == "assistant" and blocks[5:8] == ["tool call"] * 3
    assert blocks[11:13] == ["tool result"] * 2 and blocks[13] == ""   # a token is where its first character is


def wandb_history(run_file: str) -> list[dict]:
    """The history rows of an offline wandb run, read from its transaction log: W&B's LevelDB-style log (32 KiB
    blocks; each chunk a 7-byte header of crc, length, type) of wandb's own Record protobufs."""
    raw = open(run_file, "rb").read()
    assert raw[:4] == b":W&B"
    block, records, pending, pos = 32768, [], b"", 7
    while pos + 7 <= len(raw):
        if block - pos % block < 7:                  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        pending += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):                           # FULL or LAST: the record is whole
            records.append(pending)
            pending = b""
    history = []
    for chunk in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        if record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return history


def test_the_wandb_offline_run_logged_exactly_metrics_jsonl_and_the_traced_rows(run):
    (run_file,) = glob.glob(os.path.join(run, "wandb", "offline-run-*", "run-*.wandb"))
    history = wandb_history(run_file)
    metrics = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert len(history) == len(metrics) == 2
    for logged, record in zip(history, metrics):
        assert logged["_step"] == record["step"]
        assert {k: logged[k] for k in record} == record
        assert {k for k in logged if not k.startswith(("_", "traces/rows"))} == set(record)
    assert history[-1]["traces/rows/_type"] == "table-file"
    assert history[-1]["traces/rows/nrows"] == len(traced_rows(run))


# ---- pages stay inert: every string a model, a tool, an agent or a request wrote reaches the page as text -------

# strings that end a script block, start HTML's escaped-script state, carry live markup, end a line inside a JS
# string, or look like an entity or one of render's own placeholders
BREAKERS = ["<!--<script>", "</script>", "<script>window.__pwned=1</script>", '<img src=x onerror="window.__pwned=1">',
            '<svg onload="window.__pwned=1">', "\u2028\u2029", "]]>", "&lt;", "<!-- -->", "%DATA%"]
BREAKER_IDS = ["comment-script", "close-script", "script", "img-onerror", "svg-onload", "line-separators",
               "cdata-end", "entity", "comment", "placeholder"]


def breaker_run(folder, breakers: list[str]) -> str:
    """A run folder as train.py writes one, each breaker one agent's info name (metric agent/<name>), one token of a
    system and a user message, of a tool call and its tool output and of the sampled reply, and the run's names."""
    out = os.path.join(folder, "out")
    os.makedirs(os.path.join(out, "traces"))
    names = " ".join(breakers)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"run": {"recipe": names, "model": names, "steps": 2, "seed": 0}}, f)
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        for step in (1, 2):
            f.write(json.dumps({"step": step, "rollout/reward": step / 2,
                                **{f"agent/{b}": float(i + step) for i, b in enumerate(breakers)}}) + "\n")
    prompt = ["<|im_start|>", "system\n", *breakers, "<|im_end|>\n", "<|im_start|>", "user\n", *breakers, "<|im_end|>\n",
              "<|im_start|>", "assistant\n<tool_call>\n", *breakers, "\n</tool_call>", "<|im_end|>\n",
              "<|im_start|>", "user\n<tool_response>\n", *breakers, "\n</tool_response>", "<|im_end|>\n",
              "<|im_start|>", "assistant\n"]
    text = prompt + breakers + ["<|im_end|>"]
    n = len(text)
    for step in (1, 2):
        with open(os.path.join(out, "traces", f"step_{step:06d}.jsonl"), "w") as f:
            for k in (0, 1):
                f.write(json.dumps({
                    "step": step, "rollout_id": 2 * step + k, "group_id": 0, "segment_id": 0, "seal_reason": "",
                    "common_prefix_len": -1, "trainer_version": step, "batch_row": k, "picked": "first rows",
                    "reward": float(k), "score": float(k), "token_ids": list(range(n)), "text": text,
                    "policy_version": [step - 1] * n, "temperature": [1.0] * n, "top_p": [1.0] * n, "top_k": [-1] * n,
                    "behavior_logprob": [-0.5] * n, "trainer_logprob": [-0.6] * n, "reference_logprob": None,
                    "is_weight": [1.0] * n, "mask_reason": ["context"] * len(prompt) + ["trained"] * (n - len(prompt)),
                    "advantage": [k - 0.5] * n, "loss_contribution": [0.01] * n, "images": []}) + "\n")
    return out


def markup_of_theirs(browser) -> dict:
    """What a breaker's markup did to the open page: window.__pwned set, an element left with an on* handler
    attribute (the page sets its own handlers as properties), a script element beyond the page's two."""
    browser.execute_async_script("setTimeout(arguments[0], 300)")     # an image's error event follows its failed load
    return browser.execute_script("""return {pwned: window.__pwned !== undefined, scripts: document.scripts.length,
        handlers: [...document.querySelectorAll("*")].flatMap(e => [...e.attributes]
          .filter(a => a.name.startsWith("on")).map(a => e.tagName + " " + a.name))};""")


INERT = {"pwned": False, "scripts": 2, "handlers": []}


def text_of(element) -> str:
    return element.get_attribute("textContent")


def pick(browser, token) -> dict[str, str]:
    """Click a token (pinning it) and read its record as the panel shows it, field name -> text."""
    token.click()
    cells = browser.find_elements("css selector", "#record td")
    return {text_of(k): text_of(v) for k, v in zip(cells[::2], cells[1::2])}


@pytest.mark.parametrize("breakers", [[b] for b in BREAKERS] + [BREAKERS], ids=BREAKER_IDS + ["all"])
def test_a_run_page_shows_every_breaker_as_text_and_runs_none_of_it(breakers, tmp_path, browser):
    out = breaker_run(tmp_path, breakers)
    open_page(browser, viewer.write_run_page(out))
    step = Select(browser.find_element("id", "step"))
    assert [o.get_attribute("value") for o in step.options] == ["all", "1", "2"], "the page's own script never ran"
    for b in breakers:                                   # add a curve: an agent's info name, picked by a reader
        key = f"agent/{b}"
        index = browser.execute_script("return [...document.getElementById('more').options]"
                                       ".findIndex(o => o.value === arguments[0])", key)
        assert index > 0 and text_of(Select(browser.find_element("id", "more")).options[index]) == key
        Select(browser.find_element("id", "more")).select_by_index(index)
    assert markup_of_theirs(browser) == INERT
    titles = browser.find_elements("css selector", "#curves .chart .t")
    assert len(titles) == 1 + len(breakers)             # rollout/reward, then one curve per name added
    for b, title in zip(breakers, titles[1:]):
        assert title.get_attribute("title") == f"agent/{b}" and text_of(title).startswith(f"agent/{b} last ")
    assert text_of(browser.find_element("tag name", "h1")) == f"{' '.join(breakers)} run out"
    assert text_of(browser.find_element("css selector", "header .sub")) == f"model {' '.join(breakers)}, steps 2, seed 0"
    step.select_by_value("1")                            # the step selector still filters
    assert browser.find_element("id", "count").text == "2 of 4 rows"
    text = traced_rows(out)[0]["text"]
    for card in browser.find_elements("css selector", "#rows .row"):
        tokens = card.find_elements("css selector", ".tok")
        assert [text_of(t) for t in tokens] == text      # every token's text as written, no markup made of it
    tool_output, sampled = text.index(breakers[0], text.index("user\n<tool_response>\n")), len(text) - 1 - len(breakers)
    for t, block in [(tool_output, "tool result"), (sampled, "")]:
        record = pick(browser, tokens[t])
        assert record["text"] == browser.execute_script("return JSON.stringify(arguments[0])", breakers[0])
        assert record.get("block", "") == block and record["position"] == str(t)
        pick(browser, tokens[t])                         # release the pin
    assert markup_of_theirs(browser) == INERT
    assert js_errors(browser) == []


@pytest.fixture(scope="module")
def breaker_session(tmp_path_factory):
    """A loopback session per set of breakers, its request holding each: in its system and user messages, a tool
    call's arguments, the tool's output, the tool's description and the response_format schema (the grammar's spec).
    Returns the saved GET /s/<id>/view page and the session's trace."""
    tok = models.bpe_tokenizer()
    server = LoopbackServer(EmbeddedEngine(models.tiny_model("qwen3", seed=1).eval(), tokenizer=tok), tok,
                            template=data.CHATML_TEMPLATE)
    server.start()

    def session(breakers: list[str]) -> tuple[str, dict]:
        info = server.create_session()
        client = openai.OpenAI(base_url=info.base_url, api_key=info.api_key, max_retries=0)
        names = " ".join(breakers)
        tools = [{"type": "function", "function": {"name": "look", "description": names, "parameters": {
            "type": "object", "properties": {"q": {"type": "string", "description": names}}}}}]
        messages = [{"role": "system", "content": names}, {"role": "user", "content": names},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                        "name": "look", "arguments": json.dumps({"q": names})}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": names}]
        schema = {"type": "object", "properties": {b: {"type": "string"} for b in breakers}}
        client.chat.completions.create(model="m", max_tokens=6, messages=messages, tools=tools, response_format={
            "type": "json_schema", "json_schema": {"name": "breakers", "schema": schema}})
        auth = {"Authorization": f"Bearer {info.api_key}"}
        with urllib.request.urlopen(urllib.request.Request(info.trace_url, headers=auth)) as response:
            trace = json.loads(response.read())
        with urllib.request.urlopen(urllib.request.Request(info.view_url, headers=auth)) as response:
            page = response.read().decode()
        path = tmp_path_factory.mktemp("breakers") / "session.html"
        path.write_text(page)
        return str(path), trace

    yield session
    server.stop()


@pytest.mark.parametrize("breakers", [[b] for b in BREAKERS] + [BREAKERS], ids=BREAKER_IDS + ["all"])
def test_a_session_page_shows_a_request_s_breakers_as_text_and_runs_none_of_them(breakers, breaker_session, browser):
    path, trace = breaker_session(breakers)
    (segment,) = trace["segments"]
    grammar = trace["samplings"][segment["sampling"][-1]]["constraint"]
    assert list(json.loads(json.loads(grammar)["schema"])["properties"]) == breakers   # the schema's names
    open_page(browser, path)
    assert [text_of(o) for o in Select(browser.find_element("id", "step")).options] == ["session"], \
        "the page's own script never ran"
    tokens = browser.find_elements("css selector", "#rows .row .tok")
    assert [text_of(t) for t in tokens] == segment["tokens"]
    shown = "".join(segment["tokens"])
    assert all(b in shown for b in breakers if b.isascii())   # split per token, U+2028's bytes decode apart
    record = pick(browser, tokens[-1])
    assert record["grammar"] == grammar and record["text"] == browser.execute_script(
        "return JSON.stringify(arguments[0])", segment["tokens"][-1])
    assert markup_of_theirs(browser) == INERT
    assert js_errors(browser) == []


def test_the_embedded_json_holds_no_character_html_reads_and_the_script_parses_no_markup():
    page = viewer.render({"title": "t", "subtitle": "s", "history": [], "curves": [], "rows": [],
                          "breakers": BREAKERS})
    data = page.split('<script type="application/json" id="data">')[1].split("</script>")[0]
    assert not set(data) & set("<>&\u2028\u2029")
    assert json.loads(data)["breakers"] == BREAKERS
    assert "innerHTML" not in viewer.JS and "outerHTML" not in viewer.JS    # the script builds no markup from data

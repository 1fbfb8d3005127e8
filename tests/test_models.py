# Tests for models.py: the BPE tokenizer, tiny random models, cache folders, loading, and the packaged SmolLM2.
import multiprocessing as mp
import os
import re
import time

import pytest
import torch
from transformers import AutoConfig

import data
import models


# ---- tokenizer ----

def test_bpe_tokenizer_round_trips_text_and_chat_markers():
    tokenizer = models.bpe_tokenizer()
    assert 400 <= len(tokenizer) <= 1000
    texts = ["Sam has 3 apples and gets 4 more. How many apples does Sam have?",
             '{"name":"add","arguments":{"a":1,"b":[2, 3]}}', "x = \\boxed{\\frac{14}{2}}\n\ttabs  and  spaces",
             "unicode: café — 東京 🙂", "<|im_start|>user\nhi<|im_end|>\n<think>hmm</think><tool_call>{}</tool_call>"]
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    for marker in models.SPECIAL_TOKENS + models.ADDED_TOKENS:  # every chat marker is one id
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1, marker
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.chat_template == data.CHATML_TEMPLATE
    # <think> is plain text (kept by skip_special_tokens), <|im_end|> is special (dropped)
    ids = tokenizer.encode("<think>a</think>b<|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>a</think>b"


def test_bpe_tokenizer_training_is_deterministic():
    assert models.bpe_tokenizer.__wrapped__().get_vocab() == models.bpe_tokenizer().get_vocab()


def test_trap_is_armed_byte_tokens_decoding_to_having_reencode_to_canonical_ids():
    # An engine may sample a non-canonical split of a word; decoding then re-encoding silently changes the ids.
    tokenizer = models.bpe_tokenizer()
    byte_ids = tokenizer.convert_tokens_to_ids(list("Ġhaving"))  # one id per byte; Ġ is the byte-level space
    assert tokenizer.unk_token_id not in byte_ids and len(byte_ids) == 7
    assert tokenizer.decode(byte_ids) == " having"
    canonical = tokenizer.encode(" having", add_special_tokens=False)
    assert canonical != byte_ids and len(canonical) < len(byte_ids)
    assert tokenizer.decode(canonical) == " having"


# ---- tiny models ----

@pytest.mark.parametrize("kind", models.TINY_KINDS)
def test_tiny_models_build_and_forward(kind):
    tokenizer = models.bpe_tokenizer()
    model = models.tiny_model(kind)
    text_config = model.config.get_text_config()
    assert not model.training and next(model.parameters()).dtype == torch.float32
    assert text_config.num_hidden_layers == 2 and text_config.hidden_size == 64
    assert text_config.vocab_size == len(tokenizer)
    assert text_config.eos_token_id == tokenizer.eos_token_id and text_config.pad_token_id == tokenizer.pad_token_id
    ids = torch.tensor([tokenizer.encode("Sam has 3 apples.", add_special_tokens=False)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()


def test_tiny_qwen3_ties_lm_head_and_moe_has_8_experts_top2():
    qwen3 = models.tiny_model("qwen3")
    assert qwen3.lm_head.weight.data_ptr() == qwen3.model.embed_tokens.weight.data_ptr()
    moe = models.tiny_model("qwen3_moe")
    assert moe.config.num_experts == 8 and moe.config.num_experts_per_tok == 2
    assert moe.lm_head.weight.data_ptr() != moe.model.embed_tokens.weight.data_ptr()


def test_tiny_model_weights_are_a_function_of_the_seed_alone():
    torch.manual_seed(123)
    expected_next_draw = torch.rand(1)
    torch.manual_seed(123)
    first, again, other = (models.tiny_model("qwen3", seed) for seed in (0, 0, 1))
    assert torch.equal(torch.rand(1), expected_next_draw)  # the caller's RNG stream is untouched
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), again.parameters()))
    assert not torch.equal(first.model.embed_tokens.weight, other.model.embed_tokens.weight)


def test_left_padded_and_unpadded_logits_agree():
    tokenizer = models.bpe_tokenizer()
    model = models.tiny_model("qwen3")
    long_ids = tokenizer.encode("Sam has 3 apples and gets 4 more.", add_special_tokens=False)
    short_ids = tokenizer.encode("Mia has 12.", add_special_tokens=False)
    pad = len(long_ids) - len(short_ids)
    input_ids = torch.tensor([long_ids, [tokenizer.pad_token_id] * pad + short_ids])
    attention_mask = torch.tensor([[1] * len(long_ids), [0] * pad + [1] * len(short_ids)])
    with torch.no_grad():
        padded = model(input_ids=input_ids, attention_mask=attention_mask).logits
        unmasked = model(input_ids=input_ids).logits  # negative control: pads visible to attention
        alone_long = model(input_ids=torch.tensor([long_ids])).logits[0]
        alone_short = model(input_ids=torch.tensor([short_ids])).logits[0]
    assert (unmasked[1, pad:] - alone_short).abs().max() > 1e-3  # the trap is armed: padding matters
    torch.testing.assert_close(padded[0], alone_long, atol=1e-5, rtol=0)
    torch.testing.assert_close(padded[1, pad:], alone_short, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", models.TINY_KINDS)
def test_the_tiny_models_hold_a_harness_context_read_from_their_text_config(kind):
    config = models.tiny_model(kind).config
    assert models.position_limit(config) == config.get_text_config().max_position_embeddings == 65536
    with torch.no_grad():           # the last position still computes (RoPE: any position; a VLM's 3-D ones too)
        ids = torch.tensor([[5, 6]])
        positions = torch.tensor([[65534, 65535]])
        positions = positions.expand(3, 1, 2) if kind == "qwen2_5_vl" else positions
        assert torch.isfinite(models.tiny_model(kind)(input_ids=ids, position_ids=positions).logits).all()


def test_a_tiny_model_folder_is_keyed_on_its_positions(tmp_path, monkeypatch):
    """A folder (and every taught folder, keyed on its path) written at another position limit is never reused."""
    monkeypatch.setenv("TRACERL_CACHE", str(tmp_path))
    folder = models.tiny_model_dir("qwen3")
    monkeypatch.setattr(models, "TINY_POSITIONS", 4096)
    older = models.tiny_model_dir("qwen3")
    assert older != folder
    assert [models.position_limit(AutoConfig.from_pretrained(f)) for f in (folder, older)] == [65536, 4096]


# ---- cache folders, resolve, load ----

def test_tiny_model_dir_is_written_once_and_loads_identical_model(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACERL_CACHE", str(tmp_path))
    folder = models.tiny_model_dir("qwen3")
    assert folder.startswith(str(tmp_path)) and os.path.exists(os.path.join(folder, models.COMPLETE_MARKER))
    assert [name for name in os.listdir(tmp_path) if ".tmp-" in name] == []  # no temporary left behind
    stamp = os.path.getmtime(os.path.join(folder, "model.safetensors"))
    assert models.tiny_model_dir("qwen3") == folder
    assert os.path.getmtime(os.path.join(folder, "model.safetensors")) == stamp  # not rewritten
    loaded, tokenizer = models.load_model(folder), models.load_tokenizer(folder)
    assert not loaded.training and loaded.config._attn_implementation == models.ATTN_IMPLEMENTATION
    text = "What is 2 plus 6? <think>8</think>"
    assert tokenizer.encode(text) == models.bpe_tokenizer().encode(text)
    assert tokenizer.chat_template == data.CHATML_TEMPLATE and tokenizer.eos_token == "<|im_end|>"
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, models.tiny_model("qwen3")(input_ids=ids).logits)


def test_reply_mask_marks_the_assistant_replies_and_their_end_alone():
    tokenizer = models.bpe_tokenizer()
    text = data.render_prompt_text(tokenizer, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Two plus two?"},
        {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three?"},
        {"role": "assistant", "content": "Five."}], add_generation_prompt=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    mask = models.reply_mask(tokenizer, ids)
    marked = tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert marked == "Four.<|im_end|>Five.<|im_end|>"


def test_taught_replies_model_writes_each_reply_after_a_shared_prefix_it_was_not_trained_to_predict(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRACERL_CACHE", str(tmp_path))
    tokenizer = models.bpe_tokenizer()
    system = "You are a helpful assistant. " * 40           # the long prefix every conversation shares
    pairs = [("What is 2 plus 3?", "The answer is \\boxed{5}."), ("What is 4 plus 4?", "The answer is \\boxed{8}."),
             ("Sam has three apples.", "Sam has 3 apples.")]
    texts = [data.render_prompt_text(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": q},
                                                 {"role": "assistant", "content": a}], add_generation_prompt=False)
             for q, a in pairs]
    folder = models.taught_replies_model_dir(texts, steps=80)
    assert models.taught_replies_model_dir(texts, steps=80) == folder                  # cached

    def hits(model, text) -> tuple[float, float]:
        """The fractions of reply ids and of the prefix's first 200 ids that greedy decoding writes."""
        ids = tokenizer.encode(text, add_special_tokens=False)
        mask = models.reply_mask(tokenizer, ids)
        with torch.no_grad():
            predicted = model(input_ids=torch.tensor([ids])).logits[0, :-1].argmax(-1).tolist()
        right = [p == t for p, t in zip(predicted, ids[1:])]
        replies = [r for r, m in zip(right, mask[1:]) if m]
        return sum(replies) / len(replies), sum(right[:200]) / 200
    taught = models.load_model(folder)
    assert all(hits(taught, text)[0] == 1.0 for text in texts)     # every reply id, its end included
    assert all(hits(taught, text)[1] < 0.5 for text in texts)      # the prefix was never a target...
    whole = models.load_model(models.taught_tiny_model_dir("qwen3", [(t, []) for t in texts], steps=80))
    assert all(hits(whole, text)[1] > 0.9 for text in texts)       # ...as it is when the whole text is taught
    # it teaches on until every reply id wins by its margin, and says so when twice its steps fall short
    capsys.readouterr()
    with pytest.raises(RuntimeError, match=r"after 4 steps a reply id wins by -?[0-9.]+ logits, not 2.0"):
        models.taught_replies_model_dir(texts, steps=2)
    said = capsys.readouterr().err          # its progress past its steps counts toward the most it may take
    assert "step 2/2," in said and "teaching on to 2.0" in said and "step 3/4," in said and "/2," not in \
        said.split("teaching on")[1]


def test_half_written_cache_folder_is_never_used(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACERL_CACHE", str(tmp_path))
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "junk").write_text("crashed mid-write")  # no marker
    calls = []
    folder = models._cached_folder("half", lambda tmp: calls.append(tmp))
    assert calls and not os.path.exists(os.path.join(folder, "junk"))
    assert os.path.exists(os.path.join(folder, models.COMPLETE_MARKER))


def _write_slowly(name: str, started, log: str) -> None:
    """A second process's _cached_folder of `name` (test_two_processes...): its write is slow and says it ran."""
    def write(tmp: str) -> None:
        started.set()
        time.sleep(1.0)                       # holds the lock while the other process asks for the same folder
        with open(log, "a") as f:
            f.write("wrote\n")
    models._cached_folder(name, write)


def test_two_processes_asking_for_one_folder_write_it_once_and_both_get_it(tmp_path, monkeypatch):
    """Two test workers or runs that need the same taught model at once: the second waits for the first's folder
    instead of spending the same minutes beside it. Order is forced (the second asks only once the first writes),
    so the outcome rests on no race; without the lock both would write (the log would hold two lines)."""
    monkeypatch.setenv("TRACERL_CACHE", str(tmp_path))
    log = str(tmp_path / "writes.log")
    started = mp.get_context("spawn").Event()
    other = mp.get_context("spawn").Process(target=_write_slowly, args=("shared", started, log))
    other.start()
    assert started.wait(60)
    folder = models._cached_folder("shared", lambda tmp: open(log, "a").write("wrote\n"))
    other.join(60)
    assert other.exitcode == 0 and open(log).read() == "wrote\n"
    assert os.path.exists(os.path.join(folder, models.COMPLETE_MARKER))


def test_teaching_a_model_shows_its_progress_once_and_is_silent_when_reused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRACERL_CACHE", str(tmp_path))
    examples = [("<|im_start|>assistant\nThe answer is \\boxed{4}.<|im_end|>\n", [])]
    folder = models.taught_tiny_model_dir("qwen3", examples, steps=20)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tracerl:")]   # ours alone
    assert lines[0].startswith("tracerl: teaching a tiny qwen3 model the format of 1 examples (20 steps): once, kept in")
    assert [line.split(",")[0] for line in lines[1:-1]] == [f"tracerl: teaching a tiny qwen3 model the format of 1 "
                                                            f"examples (20 steps): step {s}/20" for s in range(2, 21, 2)]
    assert re.fullmatch(r"tracerl: .*: done in \d+ s", lines[-1])
    assert models.taught_tiny_model_dir("qwen3", examples, steps=20) == folder
    assert capsys.readouterr().err == ""                        # reused: nothing taught, nothing said


def test_resolve_model_accepts_names_and_folders_and_lists_valid_names(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACERL_CACHE", str(tmp_path))
    assert models.resolve_model("tiny-qwen3") == models.tiny_model_dir("qwen3")
    assert models.resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="tiny-qwen3-moe"):
        models.resolve_model("gpt-17")


def test_tiny_vl_model_loads_by_path_as_the_vision_language_class(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACERL_CACHE", str(tmp_path))
    model = models.load_model(models.resolve_model("tiny-qwen2.5-vl"))
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    ids = torch.tensor([models.bpe_tokenizer().encode("Find x.")])
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()


# ---- SmolLM2-135M-Instruct ----

def test_smollm2_converts_offline_and_answers_with_a_number():
    # First call converts the packaged GGUF (~30 s); later calls reuse the cache folder.
    # Seen (transformers 5.19, CPU, greedy, 16 tokens): "To calculate 2 + 6, you simply add them together."
    folder = models.resolve_model("smollm2")
    assert os.path.exists(os.path.join(folder, models.COMPLETE_MARKER))
    model, tokenizer = models.load_model(folder), models.load_tokenizer(folder)
    assert next(model.parameters()).dtype == torch.float32 and tokenizer.chat_template
    prompt = data.render_prompt_ids(tokenizer, [{"role": "user", "content": "What is 2 plus 6?"}])
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True).strip()
    print("SmolLM2 greedy answer:", repr(answer))
    assert answer and any(ch.isdigit() for ch in answer)
    assert sum(word.isalpha() for word in answer.split()) >= 2  # words, not byte soup
    assert models.position_limit(AutoConfig.from_pretrained(folder)) == 8192 == model.config.max_position_embeddings

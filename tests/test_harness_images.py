# Images in tool results, in both coding harnesses run unchanged as their recipes run them (Codex's view_image tool,
# Claude Code's Read of a PNG file), through the real server, wires and ledger. A scripted episode (ScriptEngine's
# replies: a command writes a picture into the workspace, the next reply looks at it, the last answers), served as a
# vision-language model's session (the tiny VL model's image processor): the picture reaches the engine in the tool
# turn, its pads expanded by the processor and the image passed with the prompt, and the rollout's one row records
# it, the pixels the harness read and no others (armed: another picture is other pixels), every sampled token
# trainable exactly once. The same episode on a text-only session is refused at the boundary with the reason ("this
# model is text-only"), never dropped: the harness fails its turn, the runner counts the failure, nothing trains.
import base64
import io

import pytest
import torch
from PIL import Image

import data
import loopback
import models
from agents.harness import call
from engines import SamplingParams
from engines.harvest import ScriptEngine
from invariants import check_sampled_once, image_pad_runs
from recipes import claude_code, codex, swe_fix
from tests.test_harnesses import probe

LOOKS = {"codex": (codex, lambda command: call("exec_command", {"cmd": command}),
                   lambda path: call("view_image", {"path": path})),
         "claude_code": (claude_code, lambda command: call("Bash", {"command": command, "description": "Draw"}),
                         lambda path: call("Read", {"file_path": path}))}


def picture(red: int) -> Image.Image:
    """A 56x56 picture (4 pads for the tiny processor), a gradient: a harness that re-encoded it would show."""
    image = Image.new("RGB", (56, 56))
    image.putdata([(red, x * 4, y * 4) for y in range(56) for x in range(56)])
    return image


def png_base64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


class ImageScript(ScriptEngine):
    """ScriptEngine, keeping the images each request brought (one list per turn)."""

    def generate(self, prompts, params, on_token=None, images=None, **_):
        self.shown.append(list(images[0]) if images else [])
        return super().generate(prompts, params, on_token)


@pytest.mark.parametrize("name", sorted(LOOKS))
def test_a_harness_looks_at_a_picture_and_it_reaches_the_vlm_in_the_tool_turn_or_is_refused_by_a_text_model(
        name, monkeypatch, closed_sessions):
    recipe, command, look = LOOKS[name]
    tokenizer, processor = models.load_tokenizer(models.tiny_model_dir("qwen3")), models.tiny_image_processor()
    shot = picture(200)
    task = swe_fix.tasks("train", 0)[0]
    refusals, error_response = [], loopback._error_response        # what the server refused, as it answered
    monkeypatch.setattr(loopback, "_error_response", lambda wire, error, headers=None: refusals.append(
        (error.status, str(error))) or error_response(wire, error, headers))

    def episode(image_processor):
        engine = ImageScript(tokenizer)
        engine.shown, engine.replies = [], [command(f"echo {png_base64(shot)} | base64 -d > shot.png"),
                                            look("shot.png"), "The picture is red."]
        runner = type("Runner", (recipe.AgentRunner,), {"agent_cls": probe(recipe, short_prompt=True)})(
            engine, tokenizer, max_turns=6, max_length=16384, image_processor=image_processor)
        try:        # max_tokens: the command that writes the picture is a long reply
            rollouts = runner.run([task], ["g"], SamplingParams(temperature=0.7, max_tokens=1024))
        finally:
            runner.server.stop()
        return rollouts, runner.failures, engine
    rollouts, failures, engine = episode(processor)
    assert failures == {} and engine.replies == []                       # every scripted reply asked for
    (rollout,), session = rollouts, closed_sessions[-1]
    served = session.served_in_order()
    # the picture reaches the engine in the third turn alone: inside its tool result, its pads expanded
    assert [len(images) for images in engine.shown] == [0, 0, 1]
    pad = tokenizer.convert_tokens_to_ids(data.IMAGE_PAD)
    looked = tokenizer.decode(served[2].prompt_ids)
    assert image_pad_runs(served[2].prompt_ids, pad) == [4] and "<tool_response>\n<|vision_start|>" in \
        looked[looked.rindex("<|im_start|>user"):]
    # the pixels the harness read, and no others (armed: another picture is other pixels)
    expected, = data.image_inputs(processor, [shot])
    other, = data.image_inputs(processor, [picture(0)])
    recorded = engine.shown[2][0]
    assert torch.equal(recorded.pixel_values, expected.pixel_values) and recorded.grid_thw == expected.grid_thw
    assert not torch.equal(other.pixel_values, expected.pixel_values)
    # one row, the picture recorded with it, every sampled token trainable once
    assert [(row.line, row.seal_reason, len(row.images or [])) for row in rollout.rows] == [("main", "", 1)]
    assert rollout.rows[0].images[0] is recorded
    check_sampled_once(rollout.rows, rollout.generations)
    # a text-only model: the request with the picture is refused with its reason, and the episode fails, counted
    refused, failures, engine = episode(None)
    assert refused == [] and failures == {"process_exit": 1} and engine.replies == ["The picture is red."]
    assert [len(images) for images in engine.shown] == [0, 0] and refusals[-1][0] == 400
    assert "this model is text-only (it has no image processor); remove the image parts" in refusals[-1][1]

# wires/params.py — what every request field of the three wires does: honoured, a documented no-op, or refused.
#
# Owns: one table per wire, field -> (disposition, reason), covering every field of the stock SDKs' create params
# (openai.types.chat.completion_create_params, openai.types.responses.response_create_params,
# anthropic.types.message_create_params and its beta twin anthropic.types.beta.message_create_params, which
# `client.beta.messages` and Claude Code send to the same route with `?beta=true`; tests/test_wire_params.py enumerates
# their TypedDicts, so a field a new SDK adds is decided here before it is served), the vLLM-style extras agents send
# in extra_body, and the fields harnesses send that no SDK types yet (Codex's `client_metadata`, Claude Code's
# `safeguards`); and ANTHROPIC_COUNT_FIELDS, what `POST .../v1/messages/count_tokens` takes.
# docs/wire-params.md is these tables (the same test keeps it so). wires/__init__.py, wires/anthropic.py and wires/responses.py
# apply them: a key in no row is refused (it might change what is sampled, and a guess would train on a distribution
# nobody recorded), a refused field is refused whenever it is set, and a reply asked for it lists the no-ops a request
# held. Headers change nothing sampled: the server reads the key, and the sub-agent a harness names (which line a
# request joins: loopback.client_thread); an anthropic-beta value brings fields, and each is decided here
# (docs/wire-params.md lists the ones Claude Code sends).
# honoured: decoded into the sampling (the engine records it per token, so the trainer recomputes the distribution
#   each token was drawn from: invariant 3) or into the turn options (the prompt the ledger records, the parse);
#   values it cannot honour are refused with what it takes. no-op: accepted; it cannot change what is sampled or
#   trained. refused: any value but null, with the reason and what to send instead.
# Never: decodes a request (wires/__init__.py, wires/anthropic.py and wires/responses.py do).
from engines import MAX_TOP_LOGPROBS

HONOURED, NO_OP, REFUSED = "honoured", "no-op", "refused"
_CACHE = "prompt caching: a session keeps its prompt's tokens (the ledger) and the router keeps it on one engine"
_THINK = ("the chat template's thinking switch (enable_thinking; tracerl's ChatML writes an empty think block when "
          "it is false, Qwen3's template does the same)")
# the rows every wire shares, then the rows both OpenAI wires share
_SHARED: dict[str, tuple[str, str]] = {
    "model": (NO_OP, "a session serves one policy, whatever it is called"),
    "service_tier": (NO_OP, "one engine pool serves every request alike"),
    "temperature": (HONOURED, "0 is greedy decoding, recorded as top_k=1 (the point mass); recorded per token"),
    "top_p": (HONOURED, "nucleus sampling; recorded per token"),
    # the vLLM-style extras agents send in extra_body
    "top_k": (HONOURED, "keep the k most likely tokens (-1 off, 1 greedy); recorded per token"),
    "min_p": (HONOURED, "drop tokens below min_p times the most likely one's probability (0 off); recorded per token"),
    "repetition_penalty": (HONOURED, "divide a seen id's positive logit (multiply its negative one) by r, over the "
                                     "prompt and the reply so far (1 off); recorded per token"),
    "chat_template_kwargs": (HONOURED, "switches passed to the chat template (e.g. enable_thinking); a name the "
                                       "renderer uses itself (messages, add_generation_prompt, eos_token) is refused"),
    "return_token_ids": (HONOURED, "the reply carries prompt_token_ids, token_ids, the sampling recorded for its "
                                   "tokens (constraint included) and the no-op fields the request held"),
}
_OPENAI_SHARED: dict[str, tuple[str, str]] = {
    "metadata": (NO_OP, "tags for a dashboard; the session's trace is the record here"),
    "moderation": (REFUSED, "no moderation model runs here; leave 'moderation' out"),
    "parallel_tool_calls": (HONOURED, "false: sampling ends at the first '</tool_call>', so the reply holds at most "
                                      "one call"),
    "prompt_cache_key": (NO_OP, _CACHE),
    "prompt_cache_options": (NO_OP, _CACHE),
    "prompt_cache_retention": (NO_OP, _CACHE),
    "safety_identifier": (NO_OP, "an abuse-monitoring id"),
    "user": (NO_OP, "an end-user id for abuse monitoring"),
}
OPENAI_FIELDS: dict[str, tuple[str, str]] = {
    "messages": (HONOURED, "system, developer, user, assistant and tool messages; text and image_url parts (a tool "
                           "message's images reach a VLM in the tool turn; a text-only model refuses them)"),
    "audio": (REFUSED, "this server writes text, not audio; leave 'audio' out"),
    "frequency_penalty": (HONOURED, "logit -= f * (the id's count in the reply so far); 0 off; recorded per token"),
    "function_call": (REFUSED, "the deprecated form of tool_choice: send tool_choice 'auto', 'none', 'required' or "
                               "{'type': 'function', 'function': {'name': ...}}"),
    "functions": (REFUSED, "the deprecated form of tools: send tools=[{'type': 'function', 'function': <each "
                           "function>}]"),
    "logit_bias": (HONOURED, "{token id: bias in [-100, 100]} added to the logits; recorded per token"),
    "logprobs": (HONOURED, "each sampled token's behavior logprob, the one the trainer recomputes"),
    "max_completion_tokens": (HONOURED, "the most tokens sampled, at most the rest of the session's context and of "
                                        "the rollout's budget (usage.rollout_budget says a cut); unset: the rest of "
                                        "the context (as the API), bounded by the run's rollout.max_tokens (the "
                                        "standalone server's --max-tokens, default none)"),
    "max_tokens": (HONOURED, "as max_completion_tokens"),
    "modalities": (HONOURED, "['text'] only; audio output is refused"),
    "n": (HONOURED, "1 only: a session is one rollout with one ledger, so n samples of a prompt are n sessions of "
                    "one group (the runner's group size); send n separate sessions"),
    "prediction": (NO_OP, "a predicted output only speeds decoding up; it never changes what is sampled"),
    "presence_penalty": (HONOURED, "logit -= p if the id occurs in the reply so far; 0 off; recorded per token"),
    "reasoning_effort": (HONOURED, f"{_THINK}: 'none' sets it false, any other effort true; the template also gets "
                                   f"reasoning_effort itself"),
    "response_format": (HONOURED, "text (unconstrained), json_object, json_schema (strict or not): the reply's tokens "
                                  "are masked by the grammar (llguidance), recorded per token so the trainer applies "
                                  "the same mask; with tools offered under tool_choice auto the reply is that JSON "
                                  "or tool calls; a forced tool call takes the tools' grammar instead"),
    "seed": (HONOURED, "a random stream of the request's own"),
    "stop": (HONOURED, "stop strings: the reply is cut before the one that ended it; the record keeps its tokens"),
    "store": (NO_OP, "nothing is kept for a retrieval API; the session records every turn for training anyway"),
    "stream": (HONOURED, "server-sent events, the text sent as its tokens are sampled"),
    "stream_options": (HONOURED, "include_usage: a last chunk with the usage and no choices; include_obfuscation "
                                 "is a no-op"),
    "tool_choice": (HONOURED, "auto; none (the tools stay in the prompt, no call is parsed, a one-token '<tool_call>' "
                              "is banned by a -inf logit bias); required and {'type': 'function', 'function': "
                              "{'name'}}: the server writes '<tool_call>\\n' as context and the call is masked to "
                              "the tools' schemas; allowed_tools and custom tools are refused (the Responses wire "
                              "serves custom tools)"),
    "tools": (HONOURED, "function tools, rendered by the chat template; 'strict' is kept in the schema (a forced call "
                        "is masked to it, an automatic one is parsed as written); custom tools are refused (the "
                        "Responses wire serves them)"),
    "top_logprobs": (HONOURED, f"the k most likely tokens of each step, k <= {MAX_TOP_LOGPROBS}"),
    "verbosity": (NO_OP, "a hint to OpenAI's models with no counterpart in a chat template"),
    "web_search_options": (REFUSED, "no web search runs here; give the agent a search tool of its own"),
    **_OPENAI_SHARED,
    **_SHARED,
}
ANTHROPIC_FIELDS: dict[str, tuple[str, str]] = {
    "max_tokens": (HONOURED, "the most tokens sampled (required), at most the rest of the session's context and of "
                             "the rollout's budget (usage.rollout_budget says a cut)"),
    "messages": (HONOURED, "user, assistant and system turns; text, image, document (plain text or content), "
                           "tool_use, tool_result (text, image and tool_reference blocks), thinking and "
                           "redacted_thinking blocks; a final assistant turn (prefill) is refused"),
    "cache_control": (NO_OP, f"{_CACHE} (on a system, message, tool_result or tool block as well)"),
    "container": (REFUSED, "no code-execution container runs here; run code in the agent's own tools"),
    "context_management": (NO_OP, "server-side context editing (clear_thinking, clear_tool_uses, compact): no edit is "
                                  "applied here, so the history is kept whole, as sent, and recorded so; the reply's "
                                  "context_management lists no applied edits; a conversation that outgrows the "
                                  "session's context is refused as too long, and the harness compacts it itself"),
    "diagnostics": (NO_OP, "prompt-cache diagnostics; the session's trace shows what extended"),
    "inference_geo": (NO_OP, "one engine pool serves every request"),
    "metadata": (NO_OP, "a user id for abuse monitoring"),
    "output_config": (HONOURED, "format {'type': 'json_schema', 'schema'}: the reply's tokens are masked by the "
                                "schema's grammar (strict), recorded per token, tool calls admitted too under "
                                "tool_choice auto; effort is a no-op (the thinking switch is 'thinking')"),
    "speed": (NO_OP, "decoding speed never changes what is sampled"),
    "stop_sequences": (HONOURED, "stop strings: the reply is cut before the one that ended it"),
    "stream": (HONOURED, "server-sent events, text and thinking sent as their tokens are sampled"),
    "system": (HONOURED, "the system prompt (a string or text blocks)"),
    "thinking": (HONOURED, f"{_THINK}: enabled / adaptive / between_tools set it true, disabled false; budget_tokens "
                           f"is accepted and not enforced (thinking ends where the model ends it, within max_tokens); "
                           f"display 'omitted' returns each thought empty, its signature still carrying it; "
                           f"'summarized' and 'updates' return it as sampled (no summarizer runs)"),
    "tool_choice": (HONOURED, "auto; none (as OpenAI's none); any and tool {name}: the server writes '<tool_call>\\n' "
                              "as context and the call is masked to the tools' schemas; disable_parallel_tool_use "
                              "ends sampling at the first '</tool_call>'"),
    "tools": (HONOURED, "client tools {name, description, input_schema}; a deferred one (defer_loading) enters the "
                        "context where a tool_result's tool_reference block names it (its definition is written "
                        "there), so a tool the harness adds when its search finds it leaves the record unchanged; "
                        "a server-side tool search (tool_search_tool_bm25 / _regex) cannot run here, so it is "
                        "dropped and the deferred tools are rendered like any tool; other server tools (bash, code "
                        "execution, web search, ...) are refused: they would run on Anthropic's servers"),
    "user_profile_id": (NO_OP, "whom the request is on behalf of"),
    "workspace_id": (NO_OP, "an account's workspace"),
    # the beta Messages API (`client.beta.messages`, `?beta=true`): the same fields and these
    "betas": (NO_OP, "the SDK sends these as the anthropic-beta header, not in the body; a beta changes nothing here "
                     "by itself: each field it brings is decided in this table (docs/wire-params.md lists the betas)"),
    "billing_policy": (NO_OP, "who is billed; nothing is billed here"),
    "compaction": (REFUSED, "a server-side compaction request, answered with a compaction block the server writes; "
                            "send the summarizing request as an ordinary turn (the harness's own compaction), which "
                            "is sampled and recorded like any"),
    "fallback_credit_token": (NO_OP, "billing of a retry on a fallback model; nothing is billed here"),
    "fallbacks": (NO_OP, "substitute models for a declined request: a session serves one policy, which declines "
                         "nothing on policy grounds"),
    "mcp_servers": (REFUSED, "MCP servers called from Anthropic's servers; connect MCP in the agent and offer their "
                             "tools as client tools"),
    "thread": (REFUSED, "server-held conversation state; send the whole conversation every turn (the session's record "
                        "extends it token-exactly)"),
    # sent by Claude Code (its auto permission mode) and typed by no SDK yet
    "safeguards": (NO_OP, "a server-side classifier of dangerous tool calls; none runs here: every call is returned as "
                          "sampled, and the agent's own permission rules and jail (agents/sandbox.py) bound what it "
                          "runs"),
    # the shared rows: of them the Messages API's sampling fields the 2.x SDK sends through extra_body
    **_SHARED,
}
RESPONSES_FIELDS: dict[str, tuple[str, str]] = {
    "input": (HONOURED, "a string (one user message) or items: user, system, developer and assistant messages (text, "
                        "output_text and refusal parts; images as input_image URLs), function_call and "
                        "custom_tool_call, function_call_output and custom_tool_call_output (text, or input_text and "
                        "input_image parts: a VLM sees the images in the tool turn), reasoning (its encrypted_content "
                        "carries the thought as sampled) and item_reference (an output item of a response this "
                        "session stored); consecutive assistant output items are one assistant turn; other items "
                        "(hosted tools') are refused"),
    "instructions": (HONOURED, "a system message before the input (not carried over by previous_response_id)"),
    "access_programs": (NO_OP, "an OpenAI access program; one policy serves every request alike"),
    "background": (HONOURED, "false only: a response is generated while its request waits; true is refused (no "
                             "background queue runs here: send the request and wait, or stream it)"),
    "background_options": (REFUSED, "options of background execution, which is not served: leave them out"),
    "context_management": (REFUSED, "server-side compaction would rewrite the context the ledger records; compact the "
                                    "history in the agent and send it (the session seals there)"),
    "conversation": (REFUSED, "no Conversations API here: send the conversation's items in 'input', or chain "
                              "responses with previous_response_id"),
    "image": (NO_OP, "image context compression: images reach the model as its processor makes them"),
    "include": (HONOURED, "message.output_text.logprobs: each sampled token's behavior logprob, on the reply's first "
                          "output_text part; reasoning.encrypted_content: returned whether asked or not (the thought "
                          "as sampled, so an echo extends the record); the other values name items no request here "
                          "produces (no-ops)"),
    "max_output_tokens": (HONOURED, "the most tokens sampled (within the session's context and the rollout's "
                                    "budget: usage.rollout_budget says a cut); a reply cut there is status "
                                    "'incomplete' (reason max_output_tokens)"),
    "max_tool_calls": (NO_OP, "a cap on built-in tool calls, and no built-in tool runs here"),
    "previous_response_id": (HONOURED, "one of the last 16 responses this session stored (store not false): its "
                                       "input (instructions left out) and reply come before this request's input, "
                                       "so the conversation extends the record; an id it does not hold is refused"),
    "prompt": (REFUSED, "stored prompt templates live on OpenAI's platform: send 'instructions' and 'input'"),
    "reasoning": (HONOURED, f"effort: {_THINK}, 'none' sets it false, any other effort true, and the template also "
                            f"gets reasoning_effort; summary, generate_summary, context and mode are no-ops (no "
                            f"summarizer runs: a reasoning item carries the whole thought as reasoning_text)"),
    "store": (HONOURED, "true (the default) keeps the response for previous_response_id and item_reference (the "
                        "session's last 16); false keeps nothing; the session records every turn for training either "
                        "way"),
    "stream": (HONOURED, "server-sent events: text, thoughts and call arguments sent as their tokens are sampled"),
    "stream_options": (NO_OP, "include_obfuscation: no obfuscation field is sent"),
    "text": (HONOURED, "format text (unconstrained), json_object or json_schema (strict or not): the reply's tokens "
                       "are masked by the grammar (llguidance), recorded per token, as the chat wire's "
                       "response_format; verbosity is a no-op (a hint with no counterpart in a chat template)"),
    "tool_choice": (HONOURED, "auto; none (as the chat wire's); required and {'type': 'function', 'name'}: the server "
                              "writes '<tool_call>\\n' as context and the call is masked to the tools' schemas; "
                              "allowed_tools and choices of hosted, MCP, custom, shell or apply_patch tools are "
                              "refused"),
    "tools": (HONOURED, "function tools, rendered by the chat template; namespace tools' functions under their own "
                        "names (a call names its namespace back; a name two tools share is refused); web_search, "
                        "file_search and tool_search are dropped (left out of the prompt, listed in the response's "
                        "'dropped_tools': retrieval runs on OpenAI's servers, and the model answers without it); "
                        "custom tools of format text, offered to the template as a function of one string 'input' "
                        "(a call with exactly that argument is a custom_tool_call whose input is the string the model wrote; "
                        "a grammar format is refused: an automatic call is parsed as written, never masked); "
                        "code_interpreter, image_generation, mcp, computer, local_shell, shell, apply_patch "
                        "and programmatic tools are refused: the agent expects them run or called in a form this "
                        "server's model does not write (declare a function tool)"),
    "top_logprobs": (HONOURED, f"the k most likely tokens of each step, k <= {MAX_TOP_LOGPROBS} (returned with "
                               f"include message.output_text.logprobs)"),
    "truncation": (HONOURED, "'disabled' (the default): an overlong prompt is a 400; 'auto' is refused (dropping the "
                             "start of the conversation would rewrite the record: shorten it in the agent)"),
    "client_metadata": (NO_OP, "Codex's request metadata (installation, window and turn ids)"),
    **_OPENAI_SHARED,
    **_SHARED,
}
# POST /s/<id>/v1/messages/count_tokens: the fields the SDKs' count params define (each decided above, as for a
# messages request); the count is the prompt a turn with them would get, from the session's own rendering and
# encoding, and nothing is generated or recorded.
ANTHROPIC_COUNT_FIELDS = frozenset({"betas", "billing_policy", "cache_control", "compaction", "context_management",
                                    "mcp_servers", "messages", "model", "output_config", "speed", "system", "thinking",
                                    "tool_choice", "tools", "user_profile_id", "workspace_id"})

"""Token-in, token-out over random conversations (hypothesis): appended turns keep the sampled
tokens and render the rest exactly as the template would; anything else is a new segment whose
tokens are the whole conversation's rendering, counted by category."""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from loongsage.agentflow.trajectories.rendering import ChatRenderer
from loongsage.agentflow.trajectories.store import Budget, Sample, Session
from loongsage.agentflow.trajectories.tito import cut_at_stop, plan_turn
from loongsage.core.types import Status

sys.path.insert(0, str(Path(__file__).parent))
from _conversations import replies, reply_text, words  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "look it up",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


@st.composite
def conversations(draw):
    """``(tools, system, [(new messages, reply, stopped)])`` of 1-4 turns; tool replies get results."""
    tools = draw(st.sampled_from([None, TOOLS]))
    system = [{"role": "system", "content": draw(words)}] if draw(st.booleans()) else []
    turns, previous = [], None
    for _ in range(draw(st.integers(1, 4))):
        new = [
            {"role": "tool", "content": draw(words), "tool_call_id": c["id"]}
            for c in (previous or {}).get("tool_calls", [])
        ]
        if not new or draw(st.booleans()):
            new.append({"role": "user", "content": draw(words)})
        previous = draw(replies(tools=tools is not None))
        turns.append((new, previous, draw(st.booleans())))
    return tools, system, turns


def _play(session, renderer, tools, history, new, reply, stopped, eos):
    """One turn through the planner and the store, the reply's tokens being what a model writes for it."""
    messages = [*history, *new]
    plan = plan_turn(session.lines, messages, tools, renderer)
    ids = renderer.encode(reply_text(renderer, reply, tools)) + ([eos] if stopped else [])
    sample = Sample(
        ids,
        [-0.25] * len(ids),
        [7] * len(ids),
        "stop" if stopped else "length",
        reply,
        renderer.tail(eos if stopped else None),
    )
    session.commit(plan, messages, tools, [sample], [False])
    return plan, ids, [*messages, reply]


@settings(max_examples=25, deadline=None)
@given(conv=conversations())
def test_appended_turns_keep_the_sampled_tokens_and_render_like_the_template(tokenizer, conv):
    tools, system, turns = conv
    renderer, eos = ChatRenderer(tokenizer), tokenizer.eos_token_id
    session = Session("t", 0, Budget(), None)
    history, outputs = list(system), []
    for k, (new, reply, stopped) in enumerate(turns):
        line_before = list(session.lines[0].tokens) if session.lines else []
        plan, ids, history = _play(session, renderer, tools, history, new, reply, stopped, eos)
        assert plan.category == ("first" if k == 0 else None)
        (line,) = session.lines
        # the engine saw exactly the line so far plus the appended prompt; the reply went on unchanged
        assert plan.prompt == line_before + plan.appended
        assert line.tokens == plan.prompt + ids
        outputs.append(ids)
    (line,) = session.lines
    assert [s[2] for s in line.segments] == ["first"] and line.segments[0][:2] == [0, len(line.tokens)]
    assert [t for t, m in zip(line.tokens, line.mask) if m] == [t for ids in outputs for t in ids]
    assert all(
        (v == 7) == bool(m) and (lp == -0.25) == bool(m) for v, m, lp in zip(line.versions, line.mask, line.logprobs)
    )
    # appended text = the template's rendering of the whole conversation (tokens never re-derived)
    assert renderer.decode(line.tokens) + line.tail == renderer.render(history, tools, generation_prompt=False)
    (trajectory,) = session.trajectories(source="s", group_id=3)
    assert trajectory.prompt_ids + trajectory.response_ids == line.tokens
    assert trajectory.prompt_ids == renderer.prompt([*system, *turns[0][0]], tools)
    assert sum(trajectory.loss_mask) == sum(map(len, outputs)) and trajectory.status is Status.OK
    assert trajectory.metadata["messages"] == history and len(trajectory.metadata["turns"]) == len(turns)


@settings(max_examples=25, deadline=None)
@given(
    conv=conversations(),
    change=st.sampled_from(
        ["rewritten", "reasoning_dropped", "compaction", "tools_changed", "reply_edited", "rewound"]
    ),
    data=st.data(),
)
def test_anything_else_starts_a_new_segment_counted_by_category(tokenizer, conv, change, data):
    tools, system, turns = conv
    assume(len(turns) >= 2)
    renderer, eos = ChatRenderer(tokenizer), tokenizer.eos_token_id
    session = Session("t", 0, Budget(), None)
    history = list(system)
    for new, reply, stopped in turns:
        _, _, history = _play(session, renderer, tools, history, new, reply, stopped, eos)
    old = session.lines[0].copy()
    sent, sent_tools = [dict(m) for m in history], tools
    last = len(sent) - 1
    if change == "rewritten":
        # the first user message (without a system prompt nothing is shared: a side conversation)
        sent[len(system)]["content"] += " (edited)"
        change = "rewritten" if system else "new_conversation"
    elif change == "reasoning_dropped":
        with_reasoning = [i for i, m in enumerate(sent) if m.get("reasoning_content")]
        assume(with_reasoning)
        del sent[data.draw(st.sampled_from(with_reasoning))]["reasoning_content"]
    elif change == "compaction":
        # the first message kept (a conversation sharing nothing is a side conversation)
        sent = [sent[0], {"role": "user", "content": "summary of the work so far"}]
        assume(len(sent) < len(history))
    elif change == "tools_changed":
        sent_tools = None if tools else TOOLS
    elif change == "reply_edited":
        sent[last]["content"] += " (edited)"
    elif change == "rewound":
        sent = sent[: len(system) + len(turns[0][0]) + 1]  # on from the first reply
    sent.append({"role": "user", "content": "next"})
    plan = plan_turn(session.lines, sent, sent_tools, renderer)
    assert plan.category == change
    # the new segment's prompt is the whole conversation's rendering
    assert plan.prompt == plan.appended == renderer.prompt(sent, sent_tools)
    ids = renderer.encode("fine")
    session.commit(
        plan,
        sent,
        sent_tools,
        [Sample(ids, [0.0] * len(ids), [1] * len(ids), "length", {"role": "assistant", "content": "fine"}, "")],
        [False],
    )
    assert session.categories[change] == 1
    if change in ("rewound", "new_conversation"):  # a branch, or another conversation: a line of its own
        assert len(session.lines) == 2 and session.lines[1].tokens == plan.prompt + ids
        return
    (line,) = session.lines
    assert line.tokens[: len(old.tokens)] == old.tokens and line.mask[: len(old.mask)] == old.mask
    assert line.segments[-1] == [len(old.tokens), len(line.tokens), change]
    trajectory = session.trajectories()[0]
    assert [s.kind for s in trajectory.segments] == ["turn", "compaction" if change == "compaction" else "rewritten"]


def test_a_conversation_sharing_nothing_with_the_session_starts_a_line(tokenizer):
    renderer = ChatRenderer(tokenizer)
    session = Session("t", 0, Budget(), None)
    reply = {"role": "assistant", "content": "a"}
    _play(session, renderer, None, [], [{"role": "user", "content": "main"}], reply, True, tokenizer.eos_token_id)
    plan = plan_turn(session.lines, [{"role": "user", "content": "title please"}], None, renderer)
    assert plan.category == "new_conversation" and plan.line is None


def test_a_reply_sent_back_with_other_json_types_is_not_the_models_reply():
    """``true == 1 == 1.0`` in Python, not in JSON: a tool call's arguments sent back with another
    type are an edited reply, or the line would record the client's message beside the model's tokens."""
    from loongsage.agentflow.chat.messages import same

    def call(arguments):
        function = {"name": "f", "arguments": arguments}
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c", "type": "function", "function": function}],
        }

    model = call({"flag": True, "n": 1, "x": [1.5, None]})
    assert same(model, call({"n": 1, "x": [1.5, None], "flag": True}), reasoning_optional=False)  # key order is free
    for edited in (
        {"flag": 1, "n": 1, "x": [1.5, None]},
        {"flag": True, "n": True, "x": [1.5, None]},
        {"flag": True, "n": 1.0, "x": [1.5, None]},
        {"flag": True, "n": 1, "x": (1.5, None)},
    ):
        assert not same(model, call(edited), reasoning_optional=False), edited
        assert not same(model, call(edited), reasoning_optional=True), edited


def test_reasoning_may_be_optional(tokenizer):
    """With reasoning_optional a client that drops a reply's reasoning still extends the line
    (its think tokens stay in the trajectory)."""
    renderer = ChatRenderer(tokenizer)
    session = Session("t", 0, Budget(), None)
    reply = {"role": "assistant", "content": "4", "reasoning_content": "2+2"}
    _, _, history = _play(
        session, renderer, None, [], [{"role": "user", "content": "2+2?"}], reply, True, tokenizer.eos_token_id
    )
    sent = [history[0], {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]
    assert plan_turn(session.lines, sent, None, renderer).category == "reasoning_dropped"
    assert plan_turn(session.lines, sent, None, renderer, reasoning_optional=True).category is None


def test_stop_strings_cut_the_tokens_at_the_shortest_prefix(tokenizer):
    renderer = ChatRenderer(tokenizer)
    ids = renderer.encode("The answer is 42. Done here. More text")
    kept, text, stop = cut_at_stop(renderer.decode, ids, ["Done", "nothing"])
    assert stop == "Done" and text == "The answer is 42. "
    assert "Done" in renderer.decode(ids[:kept]) and "Done" not in renderer.decode(ids[: kept - 1])
    assert cut_at_stop(renderer.decode, ids, ["absent"]) == (len(ids), renderer.decode(ids), None)

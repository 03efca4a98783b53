"""Hypothesis strategies for chat conversations and the canonical text of a reply."""

from __future__ import annotations

from hypothesis import strategies as st

from loongsage.agentflow.chat.messages import assistant, tool_call

# no markup characters, no edge whitespace: what a parser strips and a tag would confuse
_CHARS = st.sampled_from(list("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,:;!?'\"-+=*/()[]{}\n") + ["é", "中", "ß"])
words = st.text(_CHARS, min_size=1, max_size=30).map(str.strip).filter(bool)
names = st.from_regex(r"[a-z][a-z_]{0,10}", fullmatch=True)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | words,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=3),
    max_leaves=6,
)
arguments = st.dictionaries(names, json_values, max_size=3)


@st.composite
def replies(draw, tools: bool = True):
    calls = draw(st.lists(st.tuples(names, arguments), max_size=2)) if tools else []
    content = draw(words) if not calls or draw(st.booleans()) else ""
    reasoning = draw(words) if draw(st.booleans()) else None
    return assistant(content, reasoning, [tool_call(f"call_{i}", n, a) for i, (n, a) in enumerate(calls)])


def reply_text(renderer, reply, tools=None) -> str:
    """What the model writes for ``reply`` in this template: its rendering between the generation
    prompt and the closing."""
    user = [{"role": "user", "content": "q"}]
    before = renderer.render(user, tools, generation_prompt=True)
    full = renderer.render([*user, reply], tools, generation_prompt=False)
    assert full.startswith(before) and full.endswith(renderer.closing)
    return full[len(before) : len(full) - len(renderer.closing)]


# the tool the plumbing tests offer

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "look a number up",
        "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
    },
}

"""Token-in, token-out: the exact tokens behind each gateway session, rebuilt turn by turn.

``rendering``  the chat template rendered and tokenized: whole prompts, appended turns, the budget bound
``tito``       which tokens a turn appends to a session's line, or why it starts a new segment (pure)
``store``      sessions, their token lines (loss mask, log-probs, weight versions), segments and
               budgets; export as core ``Trajectory`` records
"""

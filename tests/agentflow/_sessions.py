"""Talking to one gateway session from a test: the official client bound to it, and closing it."""

from __future__ import annotations

import openai


def openai_client(session) -> openai.OpenAI:
    """The official client on ``session``'s base URL and key (no retries: a test sees every answer)."""
    return openai.OpenAI(base_url=session.openai_base_url, api_key=session.api_key, max_retries=0, timeout=60)


def close(gateway, session):
    """Close ``session`` on ``gateway`` (running on a thread of its own) and return it."""
    return gateway.close_session_threadsafe(session.trajectory, session.attempt)

"""The Chinese documentation (docs/zh/) keeps in step with the English one.

Every English page (README.md and docs/*.md) has its Chinese page of the same name under docs/zh/,
written in Chinese, and both show the same commands and config blocks: the fenced code blocks of the
two pages are equal, in the same order, so a command or a key changed on one side and not the other
fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ZH = REPO / "docs" / "zh"
ENGLISH = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^([ \t]*)(```+|~~~+)[^\n]*\n(.*?)^\1\2[ \t]*$", re.M | re.S)
CJK = re.compile(r"[\u4e00-\u9fff]")
LATIN = re.compile(r"[A-Za-z]")
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")


def _code_blocks(text: str) -> list[str]:
    return [m.group(0).strip() for m in FENCE.finditer(text)]


def _prose(text: str) -> str:
    """The page without its code: fenced blocks, inline code spans and link targets removed."""
    text = FENCE.sub("", text)
    return LINK_TARGET.sub("]", INLINE_CODE.sub("", text))


@pytest.mark.parametrize("english", ENGLISH, ids=lambda p: p.name)
def test_every_english_page_has_its_chinese_page_with_the_same_code_blocks(english):
    chinese = ZH / english.name
    assert chinese.is_file(), f"{english.relative_to(REPO)} has no Chinese page: write {chinese.relative_to(REPO)}"
    ours, theirs = _code_blocks(english.read_text()), _code_blocks(chinese.read_text())
    assert len(ours) == len(theirs), (
        f"{chinese.relative_to(REPO)} has {len(theirs)} code blocks, {english.relative_to(REPO)} {len(ours)}"
    )
    for number, (en, zh) in enumerate(zip(ours, theirs), 1):
        assert en == zh, f"code block {number} of {chinese.relative_to(REPO)} differs from the English page's"


@pytest.mark.parametrize("english", ENGLISH, ids=lambda p: p.name)
def test_the_chinese_page_is_written_in_chinese(english):
    chinese = ZH / english.name
    if not chinese.is_file():
        pytest.skip("no Chinese page (the test above fails)")
    prose = _prose(chinese.read_text())
    cjk, latin = len(CJK.findall(prose)), len(LATIN.findall(prose))
    # Chinese prose keeps English names (packages, keys, peers), but most of its letters are Chinese
    assert cjk >= latin, f"{chinese.relative_to(REPO)}: {cjk} Chinese characters against {latin} Latin letters"


def test_no_chinese_page_without_an_english_one():
    names = {p.name for p in ENGLISH}
    orphans = sorted(p.name for p in ZH.glob("*.md") if p.name not in names)
    assert not orphans, f"docs/zh/ pages without an English page: {orphans}"

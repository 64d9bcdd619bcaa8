"""What the docs tests read in a Markdown page (README.md, docs/*.md): the shell commands of its code
blocks and the text of one section."""

import re
import shlex


def commands(text: str):
    """`(line, the words after "python")` of each shell command that runs python in the fenced code
    blocks (indented ones under list items too), continuation lines joined, comments dropped."""
    for indent, block in re.findall(r"^( *)```[a-z]*\n(.*?)^\1```", text, re.M | re.S):
        block = re.sub(rf"^{indent}", "", block, flags=re.M)
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # an unbalanced quote in a non-shell block (e.g. python output)
                continue
            if "python" in words:
                yield line, words[words.index("python") + 1:]


def section(text: str, title: str) -> str:
    """From the heading `title` to the next `## ` heading (or the end)."""
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start:end if end >= 0 else len(text)]

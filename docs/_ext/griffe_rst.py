"""Griffe extension: render the reST habits of kfac's docstrings as Markdown.

The docstrings of ``kfac/`` are Google style but use a few reStructuredText
constructs that Markdown does not know. This extension rewrites each
docstring's text before mkdocstrings parses it, so the package itself does
not have to change:

* roles such as ``:class:`~kfac.x.Y``` become cross-references to the API
  pages when they name a ``kfac`` object (an *optional* autoref: it falls
  back to plain code, without a warning, if the target is not rendered),
  and code spans otherwise;
* ``>>>`` doctest runs are fenced as ``pycon`` blocks (outside a fence,
  Markdown reads ``[0.5, 0.9]`` as a link reference);
* a paragraph ending in ``::`` followed by an indented literal block becomes
  a paragraph ending in ``:`` and a fenced Python block.

It is loaded by ``mkdocs.yml`` (``extensions: - docs/_ext/griffe_rst.py``).
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

_ROLE = re.compile(
    r':(?:py:)?(?P<role>class|func|meth|mod|attr|data|exc|obj|const)'
    r':`(?P<target>[^`]+)`(?P<plural> s\b)?',
)
_FENCE = re.compile(r'^\s*(```|~~~)')


def _resolve(obj: griffe.Object, target: str) -> str | None:
    """Full path of ``target`` seen from ``obj``, if it is a kfac object."""
    if target.startswith('kfac.') or target == 'kfac':
        return target
    head, _, rest = target.partition('.')
    try:
        path = obj.resolve(head)
    except (griffe.NameResolutionError, AttributeError):
        return None
    full = f'{path}.{rest}' if rest else path
    return full if full.startswith('kfac') else None


def _roles(obj: griffe.Object, text: str) -> str:
    def replace(match: re.Match[str]) -> str:
        target = match['target'].strip()
        short = target.startswith('~')
        target = target.lstrip('~')
        title = target.rsplit('.', 1)[-1] if short else target
        plural = 's' if match['plural'] else ''
        path = _resolve(obj, target)
        code = f'<code>{html.escape(title)}</code>'
        if path is not None:
            code = f'<autoref identifier="{path}" optional>{code}</autoref>'
        return code + plural

    return _ROLE.sub(replace, text)


def _fence_doctests(lines: list[str]) -> list[str]:
    out: list[str] = []
    in_fence = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if _FENCE.match(line):
            in_fence = not in_fence
        if in_fence or not line.lstrip().startswith('>>>'):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        out.append(f'{indent}```pycon')
        while i < len(lines) and lines[i].strip():
            out.append(lines[i])
            i += 1
        out.append(f'{indent}```')
    return out


def _literal_blocks(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.rstrip().endswith('::') or _FENCE.match(line):
            out.append(line)
            i += 1
            continue
        indent = len(line) - len(line.lstrip())
        pad = ' ' * indent
        head = line.rstrip()[:-1]
        if re.fullmatch(r'\w+:', head.strip()):  # a lone 'Example::'
            head = f'{pad}**{head.strip()}**'
        out.append(head)
        i += 1
        block: list[str] = []
        while i < len(lines) and (
            not lines[i].strip()
            or len(lines[i]) - len(lines[i].lstrip()) > indent
        ):
            block.append(lines[i])
            i += 1
        while block and not block[-1].strip():
            block.pop()
        cut = min(
            (len(b) - len(b.lstrip()) for b in block if b.strip()),
            default=0,
        )
        out += ['', f'{pad}```python']
        out += [pad + b[cut:] if b.strip() else '' for b in block]
        out += [f'{pad}```', '']
    return out


def _comment_docstring(obj: griffe.Object) -> str | None:
    """The ``#:`` comment lines right above an attribute, as text."""
    module = obj.module
    if not obj.is_attribute or obj.lineno is None or module is obj:
        return None
    source = module.lines
    found: list[str] = []
    index = obj.lineno - 2  # the line above, 0-based
    while index >= 0 and source[index].lstrip().startswith('#:'):
        found.insert(0, source[index].lstrip()[2:].strip())
        index -= 1
    return ' '.join(found) or None


class ReSTToMarkdown(griffe.Extension):
    """Rewrite reST roles, doctests and literal blocks in every docstring.

    Also reads Sphinx's ``#:`` comments above module and class attributes as
    their docstrings (griffe reads only string literals).
    """

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring, once it and its scope are loaded."""
        if obj.docstring is None and not obj.is_alias:
            text = _comment_docstring(obj)
            if text is not None:
                obj.docstring = griffe.Docstring(text, parent=obj)
        docstring = obj.docstring
        if docstring is None:
            return
        lines = _literal_blocks(docstring.value.split('\n'))
        lines = _fence_doctests(lines)
        docstring.value = _roles(obj, '\n'.join(lines))

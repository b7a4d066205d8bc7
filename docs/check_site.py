"""Checks the built site: every page opens, every image shows, every link and anchor leads somewhere.

    python docs/check_site.py site [--no-browser]

Two passes over the pages of ``site/`` (the output of ``mkdocs build``; ``404.html`` aside):

- the built HTML, always: every relative link names a file of the site and, with a
  ``#fragment``, an id of that page; every image and every stylesheet or script of the page
  is a file of the site; the API reference has an entry for every name of
  ``pytreeckpt.__all__``;
- a browser, where there is one: the site is served on 127.0.0.1 and every page opened in
  headless Chromium (Debian's ``chromium``, driven by Playwright; ``CHROMIUM`` names another
  binary): the page must answer 200, raise no script error, load every resource it asks
  for, show every image (decoded, of non-zero width), and each link to the site must lead to
  a page that answers 200 and, with a fragment, has that id once its scripts ran.

Links to other sites are not followed (there is no network here). Exits 1 listing every
failure, page by page; 0 with a count of what was checked.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import http.server
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

SRC_INIT = Path(__file__).resolve().parent.parent / "src" / "pytreeckpt" / "__init__.py"
API_PAGE = "api.html"


@dataclass
class Page:
    """What one built page names: its ids, links, images and other resources."""

    ids: set[str] = field(default_factory=set)
    links: list[str] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    resources: list[str] = field(default_factory=list)


class _PageParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.page = Page()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v for k, v in attrs if v is not None}
        if "id" in a:
            self.page.ids.add(a["id"])
        if tag == "a" and "name" in a:
            self.page.ids.add(a["name"])
        if tag == "a" and "href" in a:
            self.page.links.append(a["href"])
        elif tag == "img" and "src" in a:
            self.page.images.append(a["src"])
        elif tag == "script" and "src" in a:
            self.page.resources.append(a["src"])
        elif tag == "link" and "href" in a and a.get("rel") in ("stylesheet", "icon", "manifest"):
            self.page.resources.append(a["href"])


def parse_page(html: str) -> Page:
    parser = _PageParser()
    parser.feed(html)
    return parser.page


def pages_of(site: Path) -> list[str]:
    """The site's pages, as paths relative to ``site`` with "/" separators."""
    return sorted(
        p.relative_to(site).as_posix()
        for p in site.rglob("*.html")
        if p.name != "404.html" and p.relative_to(site).parts[0] not in ("assets", "search")
    )


def _is_local(ref: str) -> bool:
    scheme = urlsplit(ref).scheme
    return not scheme and not ref.startswith("//")


def _target(page: str, ref: str) -> tuple[str, str]:
    """The site path and fragment a relative ``ref`` of ``page`` names."""
    parts = urlsplit(ref)
    if not parts.path:
        return page, unquote(parts.fragment)
    joined = PurePosixPath(page).parent / unquote(parts.path)
    norm: list[str] = []
    for part in joined.parts:
        if part == "..":
            if norm:
                norm.pop()
            else:
                norm.append("..")  # outside the site: reported as missing
        elif part != ".":
            norm.append(part)
    path = "/".join(norm)
    if ref.split("#")[0].endswith("/") or not path:
        path = f"{path}/index.html".lstrip("/")
    return path, unquote(parts.fragment)


def public_names(init: Path = SRC_INIT) -> list[str]:
    """``pytreeckpt.__all__``, read from the source (no import, no torch)."""
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise SystemExit(f"{init}: no __all__")


def check_html(site: Path, names: list[str] | None = None) -> tuple[list[str], int]:
    """The failures of the built HTML, and how many references were checked."""
    failures: list[str] = []
    parsed = {p: parse_page((site / p).read_text(encoding="utf-8")) for p in pages_of(site)}
    if not parsed:
        return [f"{site}: no pages"], 0
    checked = 0
    for page, content in parsed.items():
        refs = [("link", r) for r in content.links] + [("image", r) for r in content.images]
        refs += [("resource", r) for r in content.resources]
        for kind, ref in refs:
            if not _is_local(ref) or ref.startswith(("mailto:", "javascript:", "data:")):
                continue
            checked += 1
            path, fragment = _target(page, ref)
            if not (site / path).is_file():
                failures.append(f"{page}: {kind} {ref!r}: no file {path} in the site")
            elif kind == "link" and fragment and path.endswith(".html"):
                ids = parsed[path].ids if path in parsed else parse_page((site / path).read_text(encoding="utf-8")).ids
                if fragment not in ids:
                    failures.append(f"{page}: link {ref!r}: {path} has no anchor #{fragment}")
    if names is not None:
        api = parsed.get(API_PAGE)
        if api is None:
            failures.append(f"{API_PAGE}: the API reference is missing")
        else:
            failures += [f"{API_PAGE}: no entry for pytreeckpt.{n}" for n in names if f"pytreeckpt.{n}" not in api.ids]
    return failures, checked


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def _serve(site: Path) -> Iterator[str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def find_chromium() -> str | None:
    named = os.environ.get("CHROMIUM")
    if named:
        return named
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


_PAGE_STATE = """() => ({
  ids: Array.from(document.querySelectorAll('[id]')).map(e => e.id)
       .concat(Array.from(document.querySelectorAll('a[name]')).map(e => e.name)),
  links: Array.from(document.querySelectorAll('a[href]')).map(a => a.href),
  broken: Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src),
})"""


def check_browser(site: Path, chromium: str) -> tuple[list[str], int]:
    """The failures seen when every page is opened in headless Chromium, and how many pages were opened."""
    from playwright.sync_api import sync_playwright

    failures: list[str] = []
    seen: dict[str, dict[str, Any]] = {}  # URL without fragment -> state of the page
    with _serve(site) as root, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page()
        problems: list[str] = []
        page.on("pageerror", lambda e: problems.append(f"script error: {e}"))
        page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} ({r.failure})"))
        page.on("response", lambda r: problems.extend([f"{r.status} for {r.url}"] if r.status >= 400 else []))
        for name in pages_of(site):
            problems.clear()
            url = urljoin(root, name)
            response = page.goto(url, wait_until="load")
            page.wait_for_load_state("networkidle")
            if response is None or response.status != 200:
                problems.append(f"answered {None if response is None else response.status}")
            state = page.evaluate(_PAGE_STATE)
            problems += [f"image not shown: {src}" for src in state["broken"]]
            seen[url] = state
            failures += [f"{name} (browser): {p}" for p in problems]
        for url, state in list(seen.items()):
            for href in state["links"]:
                if not href.startswith(root):
                    continue
                target, _, fragment = href.partition("#")
                if target not in seen:
                    answer = page.request.get(target)
                    if answer.status != 200:
                        failures.append(f"{url[len(root) :]} (browser): link {href} answered {answer.status}")
                        continue
                    if not target.endswith(".html") or not fragment:
                        continue
                    page.goto(target, wait_until="load")
                    seen[target] = page.evaluate(_PAGE_STATE)
                if fragment and unquote(fragment) not in seen[target]["ids"]:
                    failures.append(f"{url[len(root) :]} (browser): link {href}: no element with that id")
        browser.close()
    return failures, len(pages_of(site))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("site", type=Path, help="the built site (mkdocs build's site_dir)")
    ap.add_argument("--no-browser", action="store_true", help="check the built HTML only")
    args = ap.parse_args(argv)
    failures, refs = check_html(args.site, public_names())
    print(f"built HTML: {len(pages_of(args.site))} pages, {refs} links, images and resources checked")
    chromium = None if args.no_browser else find_chromium()
    if chromium is None:
        why = "--no-browser" if args.no_browser else "no Chromium found; CHROMIUM names one"
        print(f"browser: not run ({why})")
    else:
        found, opened = check_browser(args.site, chromium)
        failures += found
        print(f"browser: {opened} pages opened in {chromium}")
    for f in dict.fromkeys(failures):  # each once, in order
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

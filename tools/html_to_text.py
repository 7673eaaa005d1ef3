#!/usr/bin/env python3
"""Plain text from HTML pages (for example the mdBook print.html pages of rustup's offline Rust
documentation), for `fourbit prepare`: scripts, styles and navigation dropped, block elements end
with a blank line (one paragraph each, for `--documents paragraph`), entities decoded, runs of
blank lines collapsed. Standard library only.

    tools/html_to_text.py OUT.txt PAGE.html [PAGE.html ...]
"""
import html.parser
import re
import sys

SKIP = {"script", "style", "nav", "head", "noscript", "svg", "button"}
BLOCK = {"p", "div", "pre", "li", "h1", "h2", "h3", "h4", "h5", "h6", "table", "tr", "blockquote",
         "section", "article", "ul", "ol", "dl", "dt", "dd", "br", "hr"}


class TextExtractor(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out = []
        self.skip_depth = 0
        self.pre_depth = 0

    def handle_starttag(self, tag, attrs):
        if tag in SKIP:
            self.skip_depth += 1
        if tag == "pre":
            self.pre_depth += 1
        if tag in BLOCK and self.skip_depth == 0:
            self.out.append("\n\n" if tag != "br" else "\n")

    def handle_endtag(self, tag):
        if tag in SKIP and self.skip_depth > 0:
            self.skip_depth -= 1
        if tag == "pre" and self.pre_depth > 0:
            self.pre_depth -= 1
        if tag in BLOCK and self.skip_depth == 0:
            self.out.append("\n\n")

    def handle_data(self, data):
        if self.skip_depth:
            return
        if self.pre_depth:
            # Code listings keep their lines; a blank line inside one would split the paragraph.
            self.out.append(re.sub(r"\n\s*\n", "\n", data))
        else:
            self.out.append(re.sub(r"\s+", " ", data))


def page_text(path):
    parser = TextExtractor()
    with open(path, encoding="utf-8") as f:
        parser.feed(f.read())
    text = "".join(parser.out)
    lines = [line.rstrip() for line in text.split("\n")]
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    with open(sys.argv[1], "w", encoding="utf-8") as out:
        for page in sys.argv[2:]:
            out.write(page_text(page))
            out.write("\n")


if __name__ == "__main__":
    main()

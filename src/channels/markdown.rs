//! Models answer in Markdown; each chat platform has its own dialect. The answer is parsed
//! once with pulldown-cmark (CommonMark with strikethrough and tables) and written out as:
//! Slack `mrkdwn` (`*bold*`, `_italic_`, `~strike~`, `<url|text>`, with `&`, `<`, `>`
//! escaped), Telegram's HTML parse mode (only the tags Telegram accepts, text escaped),
//! HTML (Matrix `formatted_body` in `org.matrix.custom.html`, the generic channel's `html`),
//! or plain text (the resend when a platform refuses the formatting). Raw HTML in the
//! answer is never passed through: it is shown as the text it is.

use pulldown_cmark::{CodeBlockKind, Event, Options, Parser, Tag, TagEnd};

fn parser(markdown: &str) -> Parser<'_> {
    Parser::new_ext(
        markdown,
        Options::ENABLE_STRIKETHROUGH | Options::ENABLE_TABLES,
    )
}

/// Whether `markdown` has any formatting at all (emphasis, links, lists, code, headings…):
/// a plain answer is sent as plain text everywhere.
pub fn has_formatting(markdown: &str) -> bool {
    parser(markdown).any(|event| {
        !matches!(
            event,
            Event::Start(Tag::Paragraph)
                | Event::End(TagEnd::Paragraph)
                | Event::Text(_)
                | Event::SoftBreak
                | Event::HardBreak
        )
    })
}

/// Markdown as HTML, raw HTML in it escaped (Matrix `formatted_body`, generic `html`).
pub fn html(markdown: &str) -> String {
    let events = parser(markdown).map(|event| match event {
        Event::Html(raw) | Event::InlineHtml(raw) => Event::Text(raw),
        other => other,
    });
    let mut out = String::with_capacity(markdown.len() * 3 / 2);
    pulldown_cmark::html::push_html(&mut out, events);
    out.trim_end().to_string()
}

/// Markdown as Telegram's HTML parse mode: `<b>`, `<i>`, `<s>`, `<code>`, `<pre>`, `<a>`,
/// `<blockquote>`; headings bold, list items marked `•` or numbered, tables as lines of
/// cells; `&`, `<`, `>` (and `"` in links) escaped as Telegram requires.
pub fn telegram_html(markdown: &str) -> String {
    Writer::new(&TELEGRAM).write(markdown)
}

/// Markdown as Slack `mrkdwn`: `*bold*`, `_italic_`, `~strike~`, `` `code` ``, code blocks
/// in triple backticks, `<url|text>` links, `>` quotes, `•` lists; `&`, `<`, `>` escaped.
pub fn slack_mrkdwn(markdown: &str) -> String {
    Writer::new(&SLACK).write(markdown)
}

/// Markdown as plain text: the words without their marks, links as `text (url)`.
pub fn plain(markdown: &str) -> String {
    Writer::new(&PLAIN).write(markdown)
}

/// How one dialect writes each mark.
struct Dialect {
    bold: (&'static str, &'static str),
    italic: (&'static str, &'static str),
    strike: (&'static str, &'static str),
    code: (&'static str, &'static str),
    /// Before and after a code block, given its language when the fence names one.
    pre: fn(Option<&str>) -> (String, String),
    quote: Quote,
    link: fn(&str, &str) -> String,
    escape: fn(&str) -> String,
}

enum Quote {
    /// Wrapped in these.
    Tags(&'static str, &'static str),
    /// Each line starts with this.
    Prefix(&'static str),
}

fn escape_html(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

const TELEGRAM: Dialect = Dialect {
    bold: ("<b>", "</b>"),
    italic: ("<i>", "</i>"),
    strike: ("<s>", "</s>"),
    code: ("<code>", "</code>"),
    pre: |lang| match lang {
        Some(lang) => (
            format!("<pre><code class=\"language-{}\">", escape_html(lang)),
            "</code></pre>".into(),
        ),
        None => ("<pre>".into(), "</pre>".into()),
    },
    quote: Quote::Tags("<blockquote>", "</blockquote>"),
    link: |url, text| {
        format!(
            "<a href=\"{}\">{text}</a>",
            escape_html(url).replace('"', "&quot;")
        )
    },
    escape: escape_html,
};

const SLACK: Dialect = Dialect {
    bold: ("*", "*"),
    italic: ("_", "_"),
    strike: ("~", "~"),
    code: ("`", "`"),
    pre: |_| ("```\n".into(), "\n```".into()),
    quote: Quote::Prefix("> "),
    link: |url, text| {
        let url = escape_html(url).replace('|', "%7C");
        if text.is_empty() || text == url {
            format!("<{url}>")
        } else {
            format!("<{url}|{}>", text.replace('|', "¦"))
        }
    },
    escape: escape_html,
};

const PLAIN: Dialect = Dialect {
    bold: ("", ""),
    italic: ("", ""),
    strike: ("", ""),
    code: ("", ""),
    pre: |_| (String::new(), String::new()),
    quote: Quote::Prefix("> "),
    link: |url, text| {
        if text.is_empty() || text == url {
            url.to_string()
        } else {
            format!("{text} ({url})")
        }
    },
    escape: |text| text.to_string(),
};

/// Writes the events of one answer in a dialect. Block structure is kept as lines: blocks
/// apart by a blank line, list items on their own lines.
struct Writer<'d> {
    dialect: &'d Dialect,
    /// Finished output.
    out: String,
    /// Open links: the output length where each link's text began, and its URL.
    links: Vec<(usize, String)>,
    /// Open lists: the next number of each (`None`: bullets).
    lists: Vec<Option<u64>>,
    /// Where each open block quote began in `out` (for prefix quoting).
    quotes: Vec<usize>,
    /// What closes the open code block.
    pre_close: String,
    /// A quote or a list item was just opened: its first block starts right there.
    opened: bool,
    /// The cells of the table row being written.
    cells: Vec<String>,
    cell: Option<usize>,
}

impl<'d> Writer<'d> {
    fn new(dialect: &'d Dialect) -> Self {
        Writer {
            dialect,
            out: String::new(),
            links: Vec::new(),
            lists: Vec::new(),
            quotes: Vec::new(),
            pre_close: String::new(),
            opened: false,
            cells: Vec::new(),
            cell: None,
        }
    }

    /// Starts a block: on a new line, a blank line after the previous block (none inside a
    /// list item).
    fn block(&mut self) {
        if self.out.is_empty() || std::mem::take(&mut self.opened) {
            return;
        }
        let tight = !self.lists.is_empty();
        let want = if tight { "\n" } else { "\n\n" };
        while !self.out.ends_with(want) {
            if self.out.ends_with('\n') && want == "\n" {
                break;
            }
            self.out.push('\n');
        }
    }

    fn write(mut self, markdown: &str) -> String {
        for event in parser(markdown) {
            self.event(event);
        }
        self.out.trim().to_string()
    }

    fn event(&mut self, event: Event<'_>) {
        let d = self.dialect;
        if !matches!(event, Event::Start(_)) {
            self.opened = false;
        }
        match event {
            Event::Start(tag) => self.start(tag),
            Event::End(tag) => self.end(tag),
            Event::Text(text) => self.out.push_str(&(d.escape)(&text)),
            Event::Code(code) => {
                self.out.push_str(d.code.0);
                self.out.push_str(&(d.escape)(&code));
                self.out.push_str(d.code.1);
            }
            Event::Html(raw) | Event::InlineHtml(raw) => self.out.push_str(&(d.escape)(&raw)),
            Event::InlineMath(math) | Event::DisplayMath(math) => {
                self.out.push_str(&(d.escape)(&math))
            }
            Event::SoftBreak | Event::HardBreak => self.out.push('\n'),
            Event::Rule => {
                self.block();
                self.out.push_str("──────────");
            }
            Event::TaskListMarker(done) => self.out.push_str(if done { "☑ " } else { "☐ " }),
            Event::FootnoteReference(name) => {
                self.out.push_str(&format!("[{}]", (d.escape)(&name)))
            }
        }
    }

    fn start(&mut self, tag: Tag<'_>) {
        let d = self.dialect;
        match tag {
            Tag::Paragraph => self.block(),
            Tag::Heading { .. } => {
                self.block();
                self.out.push_str(d.bold.0);
            }
            Tag::BlockQuote(_) => {
                self.block();
                self.quotes.push(self.out.len());
                if let Quote::Tags(open, _) = d.quote {
                    self.out.push_str(open);
                }
                self.opened = true;
            }
            Tag::CodeBlock(kind) => {
                self.block();
                let lang = match &kind {
                    CodeBlockKind::Fenced(info) => info.split_whitespace().next(),
                    CodeBlockKind::Indented => None,
                };
                let (open, close) = (d.pre)(lang);
                self.out.push_str(&open);
                self.pre_close = close;
            }
            Tag::List(start) => {
                if self.lists.is_empty() {
                    self.block();
                }
                self.lists.push(start);
            }
            Tag::Item => {
                if !self.out.is_empty() && !self.out.ends_with('\n') {
                    self.out.push('\n');
                }
                let depth = self.lists.len().saturating_sub(1);
                self.out.push_str(&"  ".repeat(depth));
                match self.lists.last_mut() {
                    Some(Some(n)) => {
                        self.out.push_str(&format!("{n}. "));
                        *n += 1;
                    }
                    _ => self.out.push_str("• "),
                }
                self.opened = true;
            }
            Tag::Emphasis => self.out.push_str(d.italic.0),
            Tag::Strong => self.out.push_str(d.bold.0),
            Tag::Strikethrough => self.out.push_str(d.strike.0),
            Tag::Link { dest_url, .. } | Tag::Image { dest_url, .. } => {
                self.links.push((self.out.len(), dest_url.to_string()));
            }
            Tag::Table(_) => self.block(),
            Tag::TableHead | Tag::TableRow => self.cells.clear(),
            Tag::TableCell => self.cell = Some(self.out.len()),
            _ => {}
        }
    }

    fn end(&mut self, tag: TagEnd) {
        let d = self.dialect;
        match tag {
            TagEnd::Heading(_) => self.out.push_str(d.bold.1),
            TagEnd::BlockQuote(_) => {
                let start = self.quotes.pop().unwrap_or(0);
                match d.quote {
                    Quote::Tags(_, close) => {
                        let trimmed = self.out.trim_end().len();
                        self.out.truncate(trimmed);
                        self.out.push_str(close);
                    }
                    Quote::Prefix(prefix) => {
                        let quoted: String = self.out[start..]
                            .trim_end()
                            .lines()
                            .map(|line| format!("{prefix}{line}"))
                            .collect::<Vec<_>>()
                            .join("\n");
                        self.out.truncate(start);
                        self.out.push_str(&quoted);
                    }
                }
            }
            TagEnd::CodeBlock => {
                if self.out.ends_with('\n') {
                    self.out.pop();
                }
                let close = std::mem::take(&mut self.pre_close);
                self.out.push_str(&close);
            }
            TagEnd::List(_) => {
                self.lists.pop();
            }
            TagEnd::Emphasis => self.out.push_str(d.italic.1),
            TagEnd::Strong => self.out.push_str(d.bold.1),
            TagEnd::Strikethrough => self.out.push_str(d.strike.1),
            TagEnd::Link | TagEnd::Image => {
                if let Some((start, url)) = self.links.pop() {
                    let text = self.out[start..].to_string();
                    self.out.truncate(start);
                    self.out.push_str(&(d.link)(&url, &text));
                }
            }
            TagEnd::TableCell => {
                if let Some(start) = self.cell.take() {
                    let cell = self.out[start..].trim().to_string();
                    self.out.truncate(start);
                    self.cells.push(cell);
                }
            }
            TagEnd::TableHead | TagEnd::TableRow => {
                if !self.out.is_empty() && !self.out.ends_with('\n') {
                    self.out.push('\n');
                }
                let row = self.cells.join(" | ");
                self.out.push_str(&row);
                self.cells.clear();
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ANSWER: &str = "# Travel\n\nBook **economy** and keep *receipts* (see [the policy](https://x.example/p?a=1&b=2)).\n\n- flights < 6 h\n- hotels ~~4~~ 3 stars\n\n1. file\n2. wait\n\n> a quote\n\n```rust\nfn main() { a < b && c }\n```\n\nUse `x<y>` & <b>raw</b>.";

    #[test]
    fn telegram_html_escapes_and_keeps_only_its_tags() {
        let html = telegram_html(ANSWER);
        assert_eq!(
            html,
            "<b>Travel</b>\n\nBook <b>economy</b> and keep <i>receipts</i> (see <a href=\"https://x.example/p?a=1&amp;b=2\">the policy</a>).\n\n• flights &lt; 6 h\n• hotels <s>4</s> 3 stars\n\n1. file\n2. wait\n\n<blockquote>a quote</blockquote>\n\n<pre><code class=\"language-rust\">fn main() { a &lt; b &amp;&amp; c }</code></pre>\n\nUse <code>x&lt;y&gt;</code> &amp; &lt;b&gt;raw&lt;/b&gt;."
        );
    }

    #[test]
    fn slack_mrkdwn_marks_links_and_escapes() {
        assert_eq!(
            slack_mrkdwn(ANSWER),
            "*Travel*\n\nBook *economy* and keep _receipts_ (see <https://x.example/p?a=1&amp;b=2|the policy>).\n\n• flights &lt; 6 h\n• hotels ~4~ 3 stars\n\n1. file\n2. wait\n\n> a quote\n\n```\nfn main() { a &lt; b &amp;&amp; c }\n```\n\nUse `x&lt;y&gt;` &amp; &lt;b&gt;raw&lt;/b&gt;."
        );
    }

    #[test]
    fn html_and_plain() {
        let html = html(ANSWER);
        assert!(html.starts_with("<h1>Travel</h1>\n<p>Book <strong>economy</strong>"));
        assert!(html.contains("&lt;b&gt;raw&lt;/b&gt;"), "{html}");
        assert!(!html.contains("<b>raw"));
        let plain = plain(ANSWER);
        assert!(plain.starts_with("Travel\n\nBook economy and keep receipts (see the policy (https://x.example/p?a=1&b=2))."), "{plain}");
        assert!(plain.contains("• flights < 6 h"));
        assert!(plain.contains("fn main() { a < b && c }"));
    }

    #[test]
    fn plain_answers_stay_as_they_are() {
        for text in [
            "answer to: where is room 4?",
            "年假有几天？",
            "a\nb",
            "3 * 4 = 12",
        ] {
            assert!(!has_formatting(text), "{text}");
            assert_eq!(plain(text), text);
        }
        assert!(has_formatting("a **b**"));
        assert!(has_formatting("- a\n- b"));
    }

    #[test]
    fn chinese_and_nested_lists() {
        let md = "**报销流程**：\n\n1. 填写申请\n   - 附上发票\n2. 审批";
        assert_eq!(
            telegram_html(md),
            "<b>报销流程</b>：\n\n1. 填写申请\n  • 附上发票\n2. 审批"
        );
    }
}

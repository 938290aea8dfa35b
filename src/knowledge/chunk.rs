//! A document split by its structure into chunks of at most a configured size: headings
//! (Markdown `#` lines, outside code fences) open sections whose heading path each chunk
//! keeps; within a section, paragraphs are packed into chunks; a paragraph longer than a
//! chunk is cut at sentence, then word boundaries (Unicode segmentation, never inside a
//! character); each later chunk of a section begins with the end of the one before it
//! (`overlap` characters, from a word boundary), so a passage cut in two is found whole.

use unicode_segmentation::UnicodeSegmentation;

/// One chunk: the heading path of its section (`Travel > Flights`) and its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    pub heading: String,
    pub text: String,
}

/// How a text marks its headings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Structure {
    /// It has none: paragraphs only.
    Plain,
    /// Markdown: `#` lines outside code fences.
    Markdown,
    /// Lines that begin with [`HEADING_MARK`] and the heading's level (a digit): HTML
    /// rendered to text by html2text, whose code blocks come out unfenced and may hold `#`
    /// lines of their own (a root prompt).
    Marked,
}

/// Put, with the level, before each HTML heading's text before it is rendered (a
/// private-use character).
pub const HEADING_MARK: char = '\u{E000}';

/// The level and title of a heading line of `structure`, if it is one.
fn heading_of(trimmed: &str, structure: Structure, fenced: bool) -> Option<(usize, String)> {
    // A heading's own text: without html2text's link brackets, a permalink's ¶, closing
    // `#`s, and with no-break spaces as spaces.
    let clean = |t: &str| {
        t.replace("[¶]", "")
            .replace(['¶', '[', ']'], "")
            .replace('\u{a0}', " ")
            .trim()
            .trim_end_matches(['#', ' '])
            .trim()
            .to_string()
    };
    match structure {
        Structure::Plain => None,
        Structure::Markdown => {
            let level = trimmed.chars().take_while(|c| *c == '#').count();
            let rest = &trimmed[level..];
            ((1..=6).contains(&level) && rest.starts_with(' ') && !fenced)
                .then(|| (level, clean(rest)))
        }
        Structure::Marked => {
            let rest = trimmed
                .trim_start_matches(['#', ' '])
                .strip_prefix(HEADING_MARK)?;
            let level = rest.chars().next()?.to_digit(10)? as usize;
            (1..=6).contains(&level).then(|| (level, clean(&rest[1..])))
        }
    }
}

/// The sections of a text: (heading path, paragraphs).
fn sections(text: &str, structure: Structure) -> Vec<(String, Vec<String>)> {
    let markdown = structure == Structure::Markdown;
    let mut out: Vec<(String, Vec<String>)> = vec![(String::new(), Vec::new())];
    let mut path: Vec<(usize, String)> = Vec::new();
    let mut paragraph = String::new();
    let mut fenced = false;
    let flush = |paragraph: &mut String, out: &mut Vec<(String, Vec<String>)>| {
        let p = paragraph.trim();
        if !p.is_empty() {
            out.last_mut().unwrap().1.push(p.to_string());
        }
        paragraph.clear();
    };
    for line in text.lines() {
        let trimmed = line.trim_start();
        if markdown && (trimmed.starts_with("```") || trimmed.starts_with("~~~")) {
            fenced = !fenced;
        }
        if let Some((level, title)) = heading_of(trimmed, structure, fenced) {
            flush(&mut paragraph, &mut out);
            path.retain(|(l, _)| *l < level);
            path.push((level, title));
            let joined: Vec<&str> = path.iter().map(|(_, t)| t.as_str()).collect();
            out.push((joined.join(" > "), Vec::new()));
        } else if line.trim().is_empty() && !fenced {
            flush(&mut paragraph, &mut out);
        } else {
            if !paragraph.is_empty() {
                paragraph.push('\n');
            }
            paragraph.extend(line.chars().filter(|c| *c != HEADING_MARK));
        }
    }
    flush(&mut paragraph, &mut out);
    out.retain(|(_, paragraphs)| !paragraphs.is_empty());
    out
}

/// `text` cut into pieces of at most `size` characters: at sentence ends, else at word
/// boundaries, else at grapheme boundaries.
fn cut(text: &str, size: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for unit in text.split_sentence_bounds() {
        let units: Vec<&str> = if unit.chars().count() > size {
            unit.split_word_bounds().collect()
        } else {
            vec![unit]
        };
        for unit in units {
            let graphemes: Vec<&str> = if unit.chars().count() > size {
                unit.graphemes(true).collect()
            } else {
                vec![unit]
            };
            for g in graphemes {
                if current.chars().count() + g.chars().count() > size && !current.is_empty() {
                    out.push(std::mem::take(&mut current));
                }
                current.push_str(g);
            }
        }
    }
    if !current.trim().is_empty() {
        out.push(current);
    }
    out.into_iter()
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty())
        .collect()
}

/// The last `overlap` characters of `text` or fewer, starting at a word boundary.
fn tail(text: &str, overlap: usize) -> &str {
    if overlap == 0 {
        return "";
    }
    let chars = text.chars().count();
    if chars <= overlap {
        return text;
    }
    let start = text
        .char_indices()
        .nth(chars - overlap)
        .map_or(text.len(), |(i, _)| i);
    let from_word = text
        .split_word_bound_indices()
        .map(|(i, _)| i)
        .find(|i| *i >= start)
        .unwrap_or(text.len());
    text[from_word..].trim_start()
}

/// The chunks of `text`, its headings marked as `structure` says, each at most `size`
/// characters plus its overlap with the one before.
pub fn chunks(text: &str, structure: Structure, size: usize, overlap: usize) -> Vec<Piece> {
    let size = size.max(1);
    let overlap = overlap.min(size / 2);
    let mut out = Vec::new();
    for (heading, paragraphs) in sections(text, structure) {
        let mut packed: Vec<String> = Vec::new();
        let mut current = String::new();
        for paragraph in paragraphs {
            for piece in cut(&paragraph, size) {
                let len = current.chars().count();
                if len > 0 && len + 2 + piece.chars().count() > size {
                    packed.push(std::mem::take(&mut current));
                }
                if !current.is_empty() {
                    current.push_str("\n\n");
                }
                current.push_str(&piece);
            }
        }
        if !current.is_empty() {
            packed.push(current);
        }
        let mut before: Option<String> = None;
        for text in packed {
            let shown = match &before {
                Some(prev) if !tail(prev, overlap).is_empty() => {
                    format!("{} {text}", tail(prev, overlap))
                }
                _ => text.clone(),
            };
            before = Some(text);
            out.push(Piece {
                heading: heading.clone(),
                text: shown,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headings_open_sections_with_their_path() {
        let doc = "# Travel\n\nBook early.\n\n## Flights\n\nEconomy only.\n\n```\n# not a heading\n```\n\n# Leave\n\nAsk your lead.";
        let got = chunks(doc, Structure::Markdown, 1000, 0);
        let headings: Vec<&str> = got.iter().map(|p| p.heading.as_str()).collect();
        assert_eq!(headings, ["Travel", "Travel > Flights", "Leave"]);
        assert!(got[1].text.contains("# not a heading"));
    }

    #[test]
    fn marked_headings_are_the_only_headings_of_rendered_html() {
        let text = format!(
            "{HEADING_MARK}1[Users][¶]\n\nAdd one as root:\n\n# adduser ada\n\n# {HEADING_MARK}2Groups\n\nAsk."
        );
        let got = chunks(&text, Structure::Marked, 1000, 0);
        let headings: Vec<&str> = got.iter().map(|p| p.heading.as_str()).collect();
        assert_eq!(headings, ["Users", "Users > Groups"]);
        assert!(got[0].text.contains("# adduser ada"), "{:?}", got[0].text);
    }

    #[test]
    fn long_paragraphs_are_cut_at_sentences_within_the_size() {
        let paragraph = "This sentence is about forty characters. ".repeat(50);
        let got = chunks(&paragraph, Structure::Plain, 200, 0);
        assert!(got.len() >= 10);
        for p in &got {
            assert!(p.text.chars().count() <= 200, "{}", p.text.len());
            assert!(p.text.ends_with('.'), "{}", p.text);
        }
    }

    #[test]
    fn chinese_without_spaces_is_cut_within_the_size() {
        let text = "差旅政策适用于所有员工请提前两周通过门户预订机票和酒店。".repeat(40);
        let got = chunks(&text, Structure::Plain, 100, 20);
        for p in &got {
            assert!(
                p.text.chars().count() <= 100 + 21,
                "{}",
                p.text.chars().count()
            );
        }
        let joined: String = got.iter().map(|p| p.text.as_str()).collect();
        assert!(joined.contains("预订机票和酒店"));
    }

    #[test]
    fn a_later_chunk_begins_with_the_end_of_the_one_before() {
        let text = (1..=40)
            .map(|n| format!("Sentence number {n}."))
            .collect::<Vec<_>>()
            .join(" ");
        let got = chunks(&text, Structure::Plain, 120, 30);
        assert!(got.len() > 2);
        let first_end: String = got[0]
            .text
            .chars()
            .rev()
            .take(10)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        assert!(got[1].text.contains(first_end.trim()), "{:?}", got[1].text);
    }
}

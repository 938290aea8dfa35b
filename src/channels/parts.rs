//! Answers longer than a platform allows, as numbered parts. Each platform states its
//! documented text limit (`TextLimit`) in its own unit: characters, UTF-16 code units
//! (Telegram), UTF-8 bytes (WeCom), or the bytes of the text as a JSON string (Matrix and
//! Lark, whose limits are on the request or event). `split` cuts a longer text at a
//! paragraph, else a line, else a sentence, else a word boundary (Unicode text segmentation,
//! UAX #29), and only where nothing else is near at a grapheme cluster boundary: never inside
//! a character, a surrogate pair or an emoji sequence. Each part is marked `(k/n) `, and
//! every marked part fits the limit. Nothing is cut off.

use unicode_segmentation::UnicodeSegmentation;

/// How a platform counts the length of a message's text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Unicode scalar values.
    Chars,
    /// UTF-16 code units (an emoji outside the BMP counts 2).
    Utf16,
    /// UTF-8 bytes.
    Bytes,
    /// UTF-8 bytes of the text escaped as a JSON string (without its quotes).
    JsonBytes,
}

/// The longest text one message may carry on a platform.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TextLimit {
    pub max: usize,
    pub unit: Unit,
}

/// Room kept in every part for its `(k/n) ` marker (ASCII: the same in every unit).
const MARKER_ROOM: usize = 12;

impl TextLimit {
    /// No limit.
    pub const NONE: TextLimit = TextLimit {
        max: usize::MAX,
        unit: Unit::Chars,
    };

    pub const fn new(max: usize, unit: Unit) -> TextLimit {
        TextLimit { max, unit }
    }

    /// The length of `c` in this limit's unit.
    fn units(&self, c: char) -> usize {
        match self.unit {
            Unit::Chars => 1,
            Unit::Utf16 => c.len_utf16(),
            Unit::Bytes => c.len_utf8(),
            // As serde_json escapes a string: two bytes for `"`, `\` and the short control
            // escapes, six (`\u00XX`) for other control characters.
            Unit::JsonBytes => match c {
                '"' | '\\' | '\n' | '\r' | '\t' | '\u{8}' | '\u{c}' => 2,
                c if (c as u32) < 0x20 => 6,
                c => c.len_utf8(),
            },
        }
    }

    /// The length of `text` in this limit's unit.
    #[cfg(test)]
    fn measure(&self, text: &str) -> usize {
        text.chars().map(|c| self.units(c)).sum()
    }

    pub fn fits(&self, text: &str) -> bool {
        self.within(text, self.max)
    }

    /// Whether `text` is at most `budget` units long; reads no further than the budget, so
    /// a long streamed text costs the limit, not its length.
    fn within(&self, text: &str, budget: usize) -> bool {
        if budget == usize::MAX {
            return true;
        }
        let mut used = 0;
        text.chars().all(|c| {
            used += self.units(c);
            used <= budget
        })
    }

    /// The longest prefix of `text` (a byte index at a grapheme cluster boundary) that fits
    /// in `budget` units; at least one grapheme when even that does not fit, cut at a
    /// character boundary then.
    fn fitting_prefix(&self, text: &str, budget: usize) -> usize {
        let mut used = 0;
        let mut end = 0;
        for (at, grapheme) in text.grapheme_indices(true) {
            let units: usize = grapheme.chars().map(|c| self.units(c)).sum();
            if used + units > budget {
                break;
            }
            used += units;
            end = at + grapheme.len();
        }
        if end > 0 {
            return end;
        }
        // One grapheme larger than a whole message (a pathological combining sequence):
        // cut it at a character boundary rather than not at all.
        let mut used = 0;
        for (at, c) in text.char_indices() {
            used += self.units(c);
            if used > budget {
                return at.max(c.len_utf8());
            }
        }
        text.len()
    }
}

/// Where to cut `text`, which does not fit in `budget`: the best boundary in the longest
/// prefix that fits, looking no further back than its second half, so parts stay full.
fn cut_point(text: &str, limit: &TextLimit, budget: usize) -> usize {
    let end = limit.fitting_prefix(text, budget);
    let floor = end / 2;
    let head = &text[..end];
    for separator in ["\n\n", "\n"] {
        if let Some(at) = head.rfind(separator).filter(|&at| at > floor) {
            return at;
        }
    }
    // Segment a little past the cut, so that a boundary right at it is seen as one.
    let mut reach = (end + 64).min(text.len());
    while !text.is_char_boundary(reach) {
        reach += 1;
    }
    let window = &text[..reach];
    let best = |starts: &mut dyn Iterator<Item = usize>| {
        starts.filter(|&at| at > floor && at <= end).last()
    };
    if let Some(at) = best(&mut window.split_sentence_bound_indices().map(|(at, _)| at)) {
        return at;
    }
    if let Some(at) = best(&mut window.split_word_bound_indices().map(|(at, _)| at)) {
        return at;
    }
    end
}

/// `text` as the platform can take it: itself when it fits, else numbered parts that each
/// fit, in order. Parts are trimmed of the whitespace they were cut at.
pub fn split(text: &str, limit: &TextLimit) -> Vec<String> {
    if limit.fits(text) {
        return vec![text.to_string()];
    }
    let pieces = pieces(text, limit);
    let n = pieces.len();
    pieces
        .into_iter()
        .enumerate()
        .map(|(i, piece)| format!("({}/{n}) {piece}", i + 1))
        .collect()
}

/// The unmarked pieces `split` numbers.
fn pieces<'a>(text: &'a str, limit: &TextLimit) -> Vec<&'a str> {
    let budget = limit.max.saturating_sub(MARKER_ROOM).max(1);
    let mut pieces = Vec::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        if limit.within(rest, budget) {
            pieces.push(rest);
            break;
        }
        let cut = cut_point(rest, limit, budget);
        let (head, tail) = rest.split_at(cut);
        let head = head.trim_end();
        if !head.is_empty() {
            pieces.push(head);
        }
        rest = tail.trim_start();
    }
    pieces
}

/// A streamed text as the messages that show it: itself while it fits, else the pieces its
/// final parts will hold (each cut as `split` cuts it, without the `(k/n) ` marker, for
/// which room is left; a piece followed by more text is final, the last one still grows).
pub fn streamed_pieces(text: &str, limit: &TextLimit) -> Vec<String> {
    if limit.fits(text) {
        return vec![text.to_string()];
    }
    pieces(text, limit)
        .into_iter()
        .map(str::to_string)
        .collect()
}

/// What a streamed answer may show in the message being edited: the text so far while it
/// fits, else its first piece (the rest follows as parts of the answer).
pub fn first_piece(text: &str, limit: &TextLimit) -> String {
    if limit.fits(text) {
        return text.to_string();
    }
    let text = text.trim();
    let budget = limit.max.saturating_sub(MARKER_ROOM).max(1);
    text[..cut_point(text, limit, budget)]
        .trim_end()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str, limit: TextLimit) -> Vec<String> {
        let parts = split(text, &limit);
        for part in &parts {
            assert!(
                limit.fits(part),
                "a part over the limit: {}",
                limit.measure(part)
            );
        }
        // Nothing lost: the parts without their markers hold every non-space character.
        let joined: String = parts
            .iter()
            .map(|p| p.split_once(") ").map_or(p.as_str(), |(_, rest)| rest))
            .collect();
        let strip = |s: &str| s.chars().filter(|c| !c.is_whitespace()).collect::<String>();
        if parts.len() > 1 {
            assert_eq!(strip(&joined), strip(text));
        }
        parts
    }

    #[test]
    fn short_text_is_one_part_unmarked() {
        let limit = TextLimit::new(4096, Unit::Utf16);
        assert_eq!(split("hello", &limit), vec!["hello".to_string()]);
        assert_eq!(split("x", &TextLimit::NONE), vec!["x".to_string()]);
    }

    #[test]
    fn paragraphs_then_sentences_then_words() {
        let para = "word ".repeat(30);
        let text = format!("{para}\n\n{para}\n\n{para}");
        let parts = check(&text, TextLimit::new(200, Unit::Chars));
        assert_eq!(parts.len(), 3);
        assert!(parts[0].starts_with("(1/3) word"));
        assert!(parts[0].ends_with("word"));
        let sentences = "This is one sentence. ".repeat(20);
        let parts = check(&sentences, TextLimit::new(100, Unit::Chars));
        for part in &parts {
            assert!(part.ends_with('.'), "cut inside a sentence: {part:?}");
        }
        let words = "abcdefg ".repeat(40);
        for part in check(&words, TextLimit::new(50, Unit::Chars)) {
            assert!(part.ends_with("abcdefg"), "cut inside a word: {part:?}");
        }
    }

    #[test]
    fn cjk_without_spaces_is_cut_after_a_sentence() {
        let text = "这是一个没有空格的句子，用来测试分段。".repeat(40);
        let limit = TextLimit::new(2048, Unit::Bytes);
        let parts = check(&text, limit);
        assert!(parts.len() > 1);
        for part in &parts {
            assert!(
                part.ends_with('。'),
                "cut inside a Chinese sentence: {part:?}"
            );
        }
        // No sentence end at all: cut between characters, never inside one.
        let text = "汉".repeat(3000);
        let parts = check(&text, TextLimit::new(2048, Unit::Bytes));
        assert_eq!(parts.len(), 5);
    }

    #[test]
    fn emoji_sequences_and_surrogate_pairs_stay_whole() {
        // A family (ZWJ sequence, 11 UTF-16 units) and a flag, repeated with no spaces.
        let family = "👨\u{200d}👩\u{200d}👧\u{200d}👦";
        let text = format!("{family}🇯🇵").repeat(500);
        for limit in [
            TextLimit::new(4096, Unit::Utf16),
            TextLimit::new(100, Unit::Utf16),
            TextLimit::new(2048, Unit::Bytes),
        ] {
            for part in check(&text, limit) {
                let body = part.split_once(") ").unwrap().1;
                let graphemes: Vec<&str> = body.graphemes(true).collect();
                assert!(
                    graphemes.iter().all(|g| *g == family || *g == "🇯🇵"),
                    "an emoji sequence was cut"
                );
            }
        }
    }

    #[test]
    fn units_are_the_platforms() {
        assert_eq!(TextLimit::new(1, Unit::Utf16).measure("😀"), 2);
        assert_eq!(TextLimit::new(1, Unit::Bytes).measure("汉"), 3);
        assert_eq!(TextLimit::new(1, Unit::Chars).measure("汉😀"), 2);
        let json = TextLimit::new(1, Unit::JsonBytes);
        let tricky = "a\"b\\c\nd\u{1}汉";
        assert_eq!(
            json.measure(tricky),
            serde_json::to_string(tricky).unwrap().len() - 2
        );
    }

    #[test]
    fn a_streamed_text_shows_its_first_piece() {
        let limit = TextLimit::new(100, Unit::Chars);
        assert_eq!(first_piece("short", &limit), "short");
        let long = "One sentence here. ".repeat(20);
        let first = first_piece(&long, &limit);
        assert!(limit.fits(&first) && first.ends_with('.'));
        assert_eq!(
            split(&long, &limit)[0],
            format!("(1/{}) {first}", split(&long, &limit).len())
        );
    }
}

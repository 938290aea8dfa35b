//! The words a text is searched by: lowercased letters and digits; Chinese and Japanese runs,
//! which have no spaces, cut into words by jieba (search mode, so a long word is found by its
//! parts too); common English and Chinese function words left out. The same cut is made of
//! a document's chunks when they are stored and of a question when it is asked, so a Chinese
//! question finds Chinese passages on both databases.

use std::sync::LazyLock;

use jieba_rs::Jieba;
use unicode_segmentation::UnicodeSegmentation;

/// jieba with its built-in dictionary, loaded once (about a quarter of a second).
static JIEBA: LazyLock<Jieba> = LazyLock::new(Jieba::new);

/// Words too common to tell passages apart.
const STOP_WORDS: &[&str] = &[
    "a", "an", "and", "are", "as", "at", "be", "by", "can", "do", "does", "for", "from", "how",
    "i", "in", "is", "it", "of", "on", "or", "our", "that", "the", "this", "to", "was", "we",
    "what", "when", "where", "which", "who", "why", "with", "you", "your", "的", "了", "是", "在",
    "吗", "呢", "怎么", "什么", "我", "我们", "如何", "和", "与", "吧", "啊",
];

/// Whether `c` is written without spaces between words (Han, Hiragana, Katakana).
fn is_cjk(c: char) -> bool {
    matches!(c as u32,
        0x3040..=0x30FF | 0x31F0..=0x31FF | 0x3400..=0x4DBF | 0x4E00..=0x9FFF
        | 0xF900..=0xFAFF | 0x20000..=0x2FA1F)
}

/// The search words of `text`, in order (repeats kept: they weigh in the ranking).
pub fn terms(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut run = String::new();
    let mut run_is_cjk = false;
    for c in text.chars() {
        let cjk = is_cjk(c);
        if cjk != run_is_cjk && !run.is_empty() {
            words_of(&run, run_is_cjk, &mut out);
            run.clear();
        }
        run_is_cjk = cjk;
        run.push(c);
    }
    words_of(&run, run_is_cjk, &mut out);
    out
}

fn words_of(run: &str, cjk: bool, out: &mut Vec<String>) {
    if cjk {
        for token in JIEBA.cut_for_search(run, true) {
            keep(token.word, out);
        }
    } else {
        for word in run.unicode_words() {
            keep(word, out);
        }
    }
}

fn keep(word: &str, out: &mut Vec<String>) {
    // An English possessive is its noun ("policy's" is "policy").
    let word = word
        .strip_suffix("'s")
        .or_else(|| word.strip_suffix("\u{2019}s"))
        .unwrap_or(word);
    let word: String = word
        .chars()
        .filter(|c| c.is_alphanumeric())
        .flat_map(char::to_lowercase)
        .collect();
    // A lone Latin letter ("s" of "2026's") tells nothing apart.
    let lone_letter = word.len() == 1 && word.as_bytes()[0].is_ascii_alphabetic();
    if !word.is_empty() && !lone_letter && !STOP_WORDS.contains(&word.as_str()) {
        out.push(word);
    }
}

/// The distinct search words of a question, at most `max`, in order.
pub fn query_terms(question: &str, max: usize) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    terms(question)
        .into_iter()
        .filter(|t| seen.insert(t.clone()))
        .take(max)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn english_words_are_lowercased_without_punctuation_and_function_words() {
        assert_eq!(
            terms("What is the Travel-Policy's scope for 2026's trips?"),
            ["travel", "policy", "scope", "2026", "trips"]
        );
    }

    #[test]
    fn chinese_is_cut_into_words() {
        let t = terms("怎么申请报销？差旅政策适用于所有员工");
        assert!(t.contains(&"申请".to_string()), "{t:?}");
        assert!(t.contains(&"报销".to_string()), "{t:?}");
        assert!(t.contains(&"差旅".to_string()), "{t:?}");
        assert!(!t.contains(&"怎么".to_string()), "{t:?}");
        assert!(t.iter().all(|w| !w.contains('？')), "{t:?}");
    }

    #[test]
    fn mixed_text_keeps_both() {
        let t = terms("VPN 设置指南 for Linux");
        assert_eq!(t.first().map(String::as_str), Some("vpn"));
        assert!(
            t.contains(&"设置".to_string()) && t.contains(&"linux".to_string()),
            "{t:?}"
        );
    }

    #[test]
    fn a_question_asks_each_word_once() {
        assert_eq!(query_terms("leave leave policy", 10), ["leave", "policy"]);
    }
}

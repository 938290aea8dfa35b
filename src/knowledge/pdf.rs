//! PDF documents: their text layer, page by page, extracted by pdf-extract (over lopdf),
//! each page under a `Page N` heading so a passage is cited with its page. Extraction is CPU
//! work on untrusted input: it runs on a blocking thread, bounded in time
//! (`knowledge.pdf_timeout_ms`), and a panic inside the crate (it has them on malformed
//! files) is caught and answered as an unreadable PDF.

use std::time::Duration;

use super::chunk::HEADING_MARK;
use super::{Extracted, KnowledgeError};

/// Every PDF file begins with this (ISO 32000-1, 7.5.2; readers allow some bytes before it,
/// within the first kilobyte).
const MAGIC: &[u8] = b"%PDF-";

/// Whether `bytes` look like a PDF file (its header within the first kilobyte).
pub fn is_pdf(bytes: &[u8]) -> bool {
    let head = &bytes[..bytes.len().min(1024)];
    head.windows(MAGIC.len()).any(|w| w == MAGIC)
}

/// Refuses what cannot be a PDF of at most `max_bytes`, before any reading.
pub fn check(bytes: &[u8], max_bytes: usize) -> Result<(), KnowledgeError> {
    if bytes.len() > max_bytes {
        return Err(KnowledgeError::TooLarge(bytes.len(), max_bytes));
    }
    if !is_pdf(bytes) {
        return Err(KnowledgeError::Invalid(
            "the file is not a PDF (no `%PDF-` header)".into(),
        ));
    }
    Ok(())
}

/// Reads a PDF's text, its pages as `Page N` sections (marked headings,
/// `chunk::Structure::Marked`), and its title (its metadata's, else its first line);
/// refused when it cannot be read, has more than `max_pages` pages or has no text at all
/// (a scan: assistd does no OCR).
pub async fn text_of(
    bytes: Vec<u8>,
    max_bytes: usize,
    max_pages: usize,
    timeout: Duration,
) -> Result<Extracted, KnowledgeError> {
    check(&bytes, max_bytes)?;
    let reading = tokio::task::spawn_blocking(move || {
        std::panic::catch_unwind(|| pages_of(&bytes, max_pages))
    });
    let invalid = |m: String| Err(KnowledgeError::Invalid(m));
    let (title, pages) = match tokio::time::timeout(timeout, reading).await {
        Err(_) => {
            return invalid(format!(
                "the PDF took longer than {} ms to read (knowledge.pdf_timeout_ms)",
                timeout.as_millis()
            ));
        }
        Ok(Err(e)) => return invalid(format!("the PDF could not be read: {e}")),
        Ok(Ok(Err(_panic))) => {
            return invalid("the PDF could not be read (its structure is broken)".into());
        }
        Ok(Ok(Ok(Err(why)))) => return invalid(why),
        Ok(Ok(Ok(Ok(read)))) => read,
    };
    let text = paged(&pages);
    if text.is_empty() {
        return invalid("the PDF has no text layer (a scanned document needs OCR first)".into());
    }
    let title = title.or_else(|| first_line(&text).map(|l| l.chars().take(120).collect()));
    Ok(Extracted { text, title })
}

/// The title (document information dictionary) and each page's text, by pdf-extract's
/// plain-text output over lopdf. A page that cannot be read is left empty (and logged).
fn pages_of(bytes: &[u8], max_pages: usize) -> Result<(Option<String>, Vec<String>), String> {
    use pdf_extract::{Document, Object, PlainTextOutput};
    let mut doc =
        Document::load_mem(bytes).map_err(|e| format!("the PDF could not be read: {e}"))?;
    if doc.is_encrypted() && doc.decrypt("").is_err() {
        return Err("the PDF is encrypted with a password".into());
    }
    let title = doc
        .trailer
        .get(b"Info")
        .ok()
        .and_then(|info| match info {
            Object::Reference(id) => doc.get_object(*id).ok(),
            direct => Some(direct),
        })
        .and_then(|info| info.as_dict().ok())
        .and_then(|info| info.get(b"Title").ok())
        .and_then(|t| pdf_extract::decode_text_string(t).ok())
        .map(|t| t.trim().chars().take(300).collect::<String>())
        .filter(|t| !t.is_empty());
    let count = doc.get_pages().len();
    if count > max_pages {
        return Err(format!(
            "the PDF has {count} pages; at most {max_pages} are read (knowledge.pdf_max_pages)"
        ));
    }
    let mut pages = Vec::with_capacity(count);
    for n in 1..=count as u32 {
        let mut text = String::new();
        let done = pdf_extract::output_doc_page(&doc, &mut PlainTextOutput::new(&mut text), n);
        if let Err(e) = done {
            tracing::warn!(page = n, error = %e, "a PDF page could not be read; left out");
            text.clear();
        }
        pages.push(text);
    }
    Ok((title, pages))
}

/// Pages as marked `Page N` sections, each page's lines trimmed, runs of blank lines kept
/// as one (paragraph breaks), empty pages left out.
fn paged(pages: &[String]) -> String {
    let mut out = String::new();
    for (n, page) in pages.iter().enumerate() {
        let mut body = String::new();
        let mut blank = false;
        for line in page.lines() {
            // The mark is ours: a PDF's own text cannot make headings.
            let line = line.trim().replace(HEADING_MARK, "");
            if line.is_empty() {
                blank = !body.is_empty();
                continue;
            }
            if blank {
                body.push('\n');
                blank = false;
            }
            body.push_str(&line);
            body.push('\n');
        }
        if body.is_empty() {
            continue;
        }
        out.push_str(&format!("{HEADING_MARK}1Page {}\n\n{body}\n", n + 1));
    }
    out
}

/// The first line of a PDF's text that is not a page heading (its title, by default).
fn first_line(text: &str) -> Option<&str> {
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.contains(HEADING_MARK))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_become_sections_and_blank_runs_one_break() {
        let pages = vec![
            "\n\n Title line \n\n\n\nbody one\nbody two\n".to_string(),
            "  \n\n".to_string(),
            format!("third {HEADING_MARK}2Fake\n"),
        ];
        let text = paged(&pages);
        assert_eq!(
            text,
            format!(
                "{HEADING_MARK}1Page 1\n\nTitle line\n\nbody one\nbody two\n\n\
                 {HEADING_MARK}1Page 3\n\nthird 2Fake\n\n"
            )
        );
        assert_eq!(first_line(&text), Some("Title line"));
    }

    #[test]
    fn only_pdf_headers_pass() {
        assert!(is_pdf(b"%PDF-1.7\n..."));
        assert!(is_pdf(b"\xef\xbb\xbf%PDF-1.4"));
        assert!(!is_pdf(b"<html>%PDF-"[..4].as_ref()));
        assert!(matches!(
            check(b"plain words", 100),
            Err(KnowledgeError::Invalid(_))
        ));
        assert!(matches!(
            check(b"%PDF-1.7 and more", 5),
            Err(KnowledgeError::TooLarge(17, 5))
        ));
    }
}

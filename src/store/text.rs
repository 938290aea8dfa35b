//! Text from outside — model answers and streamed chunks, tool and MCP results, platform
//! messages, error texts — as both databases can store it. PostgreSQL refuses U+0000 in a
//! `text` value and the `\u0000` escape in JSON it reads ("unsupported Unicode escape
//! sequence"); a write refused for it fails the same way on every try, so a run that wrote
//! such an answer would abort forever. Every write of outside text passes through here (the
//! JSON rows of batched statements through [`storable_rows`], single values through
//! [`storable`]): U+0000 becomes U+FFFD, on both databases alike, so a text reads back the
//! same whichever one stored it. Nothing else PostgreSQL refuses can be in a Rust `String`
//! (it is valid UTF-8, without lone surrogates).

use std::borrow::Cow;

use serde_json::Value;

/// What stands in for a character the databases cannot store.
const REPLACEMENT: char = '\u{FFFD}';

/// `text` as both databases store it (borrowed, without copying, when it is storable as is).
/// A text that is itself a JSON document (a reply's content, a step's input or output) may
/// hold U+0000 as the escape `\u0000`: PostgreSQL stores that, but refuses it the moment the
/// column is read as JSON, and the chat would get the NUL; such a document has its strings
/// made storable and is written again.
pub fn storable(text: &str) -> Cow<'_, str> {
    if text.contains('\0') {
        return Cow::Owned(text.replace('\0', &REPLACEMENT.to_string()));
    }
    if text.contains("\\u0000")
        && let Ok(mut doc) = serde_json::from_str::<Value>(text)
        && make_storable(&mut doc)
    {
        return Cow::Owned(doc.to_string());
    }
    Cow::Borrowed(text)
}

/// An error text as a row keeps it: cut to 1,000 bytes, storable.
pub fn stored_error(error: &str) -> String {
    storable(&crate::domain::truncate(error, 1000)).into_owned()
}

/// [`storable`] of an optional text.
pub fn storable_opt(text: Option<&str>) -> Option<Cow<'_, str>> {
    text.map(storable)
}

/// The JSON array of `rows` that a batched statement binds as `$1`, every string in it (keys
/// included) storable.
pub fn storable_rows(rows: Vec<Value>) -> String {
    let mut rows = Value::Array(rows);
    let text = rows.to_string();
    // serde_json writes U+0000 as `\u0000`, and a JSON document held in a string shows its
    // own `\u0000` as `\\u0000`: without that sequence, every string is storable as is.
    if !text.contains("\\u0000") {
        return text;
    }
    make_storable(&mut rows);
    rows.to_string()
}

/// Makes every string of `value` storable; whether anything changed.
fn make_storable(value: &mut Value) -> bool {
    match value {
        Value::String(s) => match storable(s) {
            Cow::Owned(clean) => {
                *s = clean;
                true
            }
            Cow::Borrowed(_) => false,
        },
        Value::Array(items) => items.iter_mut().fold(false, |c, v| make_storable(v) | c),
        Value::Object(map) => {
            if map.keys().any(|k| k.contains('\0')) {
                let entries = std::mem::take(map);
                for (k, mut v) in entries {
                    make_storable(&mut v);
                    map.insert(storable(&k).into_owned(), v);
                }
                true
            } else {
                map.values_mut().fold(false, |c, v| make_storable(v) | c)
            }
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nul_becomes_the_replacement_character_everywhere_in_rows() {
        assert!(matches!(storable("plain"), Cow::Borrowed("plain")));
        assert_eq!(storable("a\0b"), "a\u{FFFD}b");
        let rows = storable_rows(vec![json!({"k\0": ["x\0", {"y": "\0"}], "n": 1})]);
        assert!(!rows.contains("\\u0000"), "{rows}");
        let back: Value = serde_json::from_str(&rows).unwrap();
        assert_eq!(back[0]["k\u{FFFD}"][0], "x\u{FFFD}");
        assert_eq!(back[0]["k\u{FFFD}"][1]["y"], "\u{FFFD}");
        // A literal backslash-u-0000 in plain text is text, not a NUL, and stays as it was.
        let literal = storable_rows(vec![json!("say \\u0000 twice")]);
        let back: Value = serde_json::from_str(&literal).unwrap();
        assert_eq!(back[0], "say \\u0000 twice");
        // A JSON document held as text (a reply's content) has its NUL escape made storable.
        let content = json!({"text": "a\0b"}).to_string();
        assert!(content.contains("\\u0000"));
        let stored = storable(&content);
        assert_eq!(
            serde_json::from_str::<Value>(&stored).unwrap()["text"],
            "a\u{FFFD}b"
        );
        let rows = storable_rows(vec![json!({ "content": content })]);
        let back: Value = serde_json::from_str(&rows).unwrap();
        let inner: Value = serde_json::from_str(back[0]["content"].as_str().unwrap()).unwrap();
        assert_eq!(inner["text"], "a\u{FFFD}b");
    }
}

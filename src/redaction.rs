//! One redaction function for everything an admin page or an audit event shows: emails,
//! phone numbers, ID-card and bank-card like numbers, API keys and bearer tokens, plus the
//! patterns configured under `[redaction] extra_patterns`. Installed once at start-up; until
//! then (and in tools that never start the app) the built-in patterns apply.

use std::sync::OnceLock;

use regex::Regex;

/// The built-in patterns, most specific first. A match becomes `[name]`, except where a
/// pattern keeps a prefix (`$1`) before it (see [`KEEP_PREFIX`]).
const BUILT_IN: &[(&str, &str)] = &[
    // URL credentials (`https://user:pass@host`) and query secrets (`?corpsecret=…`): the
    // key stays readable, the value goes.
    ("credentials", r"(://)[^/\s:@]+:[^/\s@]+@"),
    (
        "secret",
        r"(?i)([?&;\s](?:[a-z_]*token|[a-z_]*secret|[a-z_]*key|password|passwd|sig|signature|sign)=)[^&\s#\x22']+",
    ),
    ("bearer", r"(?i)\bbearer\s+[A-Za-z0-9\-._~+/]{8,}=*"),
    ("basic", r"(?i)\bbasic\s+[A-Za-z0-9+/]{8,}=*"),
    // A JSON Web Token: three base64url parts, the first a JSON header (`{"` → `eyJ`).
    (
        "jwt",
        r"\beyJ[A-Za-z0-9_\-]{4,}\.[A-Za-z0-9_\-]{4,}\.[A-Za-z0-9_\-]*",
    ),
    // Telegram bot tokens (`123456789:AA…`), as they appear in Bot API paths.
    ("bot_token", r"\d{5,12}:[A-Za-z0-9_\-]{30,}"),
    (
        "api_key",
        r"\b(?:sk|pk|rk)-[A-Za-z0-9_\-]{16,}\b|\bxox[abpors]-[A-Za-z0-9\-]{10,}\b|\bAKIA[0-9A-Z]{16}\b",
    ),
    (
        "email",
        r"\b[A-Za-z0-9._%+\-]+@[A-Za-z0-9.\-]+\.[A-Za-z]{2,}\b",
    ),
    ("id_card", r"\b\d{17}[\dXx]\b"),
    ("bank_card", r"\b\d{13,19}\b|\b\d{4}(?:[ \-]\d{4}){3,4}\b"),
    ("phone", r"\+?\d[\d \-()]{7,}\d"),
];

/// The built-in patterns that find credentials (the rest find personal data).
const CREDENTIALS: &[&str] = &[
    "credentials",
    "secret",
    "bearer",
    "basic",
    "jwt",
    "bot_token",
    "api_key",
];

/// Patterns whose first group (`://`, `?key=`) is kept in front of the redaction.
const KEEP_PREFIX: &[&str] = &["credentials", "secret"];

#[derive(Debug)]
pub struct Redactor {
    patterns: Vec<(String, Regex)>,
}

impl Redactor {
    /// The built-in patterns and `extra` ones; an invalid extra pattern is an error naming it.
    pub fn new(extra: &[String]) -> Result<Redactor, String> {
        let mut patterns = Vec::new();
        for (name, pattern) in BUILT_IN {
            // The built-in patterns are constants checked by the tests below.
            patterns.push((
                name.to_string(),
                Regex::new(pattern).expect("built-in pattern"),
            ));
        }
        for (i, pattern) in extra.iter().enumerate() {
            let re =
                Regex::new(pattern).map_err(|e| format!("redaction.extra_patterns[{i}]: {e}"))?;
            patterns.push((format!("custom{i}"), re));
        }
        Ok(Redactor { patterns })
    }

    pub fn redact(&self, text: &str) -> String {
        let mut out = text.to_string();
        for (name, re) in &self.patterns {
            if re.is_match(&out) {
                let with = if KEEP_PREFIX.contains(&name.as_str()) {
                    format!("${{1}}[{name}]")
                } else {
                    format!("[{name}]")
                };
                out = re.replace_all(&out, with.as_str()).into_owned();
            }
        }
        out
    }
}

static INSTALLED: OnceLock<Redactor> = OnceLock::new();

/// Installs the configured redactor (first call wins).
pub fn install(redactor: Redactor) {
    let _ = INSTALLED.set(redactor);
}

/// An outbound HTTP failure as text fit to store, show and log: without the request's URL
/// (Bot API paths hold the bot token, WeCom's gettoken query the corp secret), with every
/// cause in the chain, and redacted.
pub fn http_error(e: reqwest::Error) -> String {
    // The origin alone: a path can hold a token too (the Bot API's `/bot<token>/`).
    let origin = e.url().map(|u| u.origin().ascii_serialization());
    let text = outbound_error(&e.without_url());
    match origin {
        Some(origin) if origin != "null" => format!("{text} ({origin})"),
        _ => text,
    }
}

/// The one way an error of an outbound call (any crate's: reqwest, rmcp, an exporter) becomes
/// text to store, show, log or hand to a model: its whole chain of causes, every URL in it cut
/// to its endpoint ([`endpoint`]: no userinfo, query or fragment), and redacted. Built where
/// the error is caught, so no sink has to remember to clean it.
pub fn outbound_error(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    outbound_text(&text)
}

/// Text about an outbound call (an error message, a child process's output line) as fit to
/// store, show and log: every URL cut to its endpoint, then redacted.
pub fn outbound_text(text: &str) -> String {
    redact(&endpoints_only(text))
}

/// A URL as anyone may see it: scheme, host, port and path; userinfo, query and fragment
/// dropped (they carry credentials: `user:pass@`, `?api_key=`). Text that is not a URL is
/// shown as `[url]`.
pub fn endpoint(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(u) if u.has_host() => {
            let mut shown = format!("{}://{}", u.scheme(), u.host_str().unwrap_or(""));
            if let Some(port) = u.port() {
                shown.push_str(&format!(":{port}"));
            }
            shown.push_str(u.path());
            shown
        }
        _ => "[url]".to_string(),
    }
}

/// `text` with every URL in it cut to its [`endpoint`].
pub fn endpoints_only(text: &str) -> std::borrow::Cow<'_, str> {
    static URL: OnceLock<Regex> = OnceLock::new();
    // A constant pattern, checked by the tests below.
    let re = URL.get_or_init(|| {
        Regex::new(r#"\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s"'<>`\[\]{}|\\^]+"#).expect("URL pattern")
    });
    re.replace_all(text, |c: &regex::Captures<'_>| {
        let found = &c[0];
        // A URL that ends a sentence or sits in parentheses keeps that punctuation.
        let url = found.trim_end_matches(['.', ',', ';', ':', ')', '!']);
        format!("{}{}", endpoint(url), &found[url.len()..])
    })
}

/// A log line of another crate (rmcp, an exporter, hyper), whose errors name the URLs they
/// called: every URL cut to its endpoint and the built-in credential patterns redacted.
/// Personal-data patterns are left out (a log line's timestamp reads like a phone number).
pub fn foreign_log_line(text: &str) -> String {
    static ONLY_CREDENTIALS: OnceLock<Redactor> = OnceLock::new();
    let redactor = ONLY_CREDENTIALS.get_or_init(|| {
        let mut all = Redactor::new(&[]).expect("built-in patterns");
        all.patterns
            .retain(|(name, _)| CREDENTIALS.contains(&name.as_str()));
        all
    });
    redactor.redact(&endpoints_only(text))
}

/// Redacts `text` with the installed (or built-in) patterns.
pub fn redact(text: &str) -> String {
    INSTALLED
        .get_or_init(|| Redactor::new(&[]).expect("built-in patterns"))
        .redact(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_cut_to_their_endpoints() {
        let cases = [
            (
                "error sending request for url (https://u:p4ss@mcp.example:8443/mcp?api_key=K3Y#frag): refused",
                "error sending request for url (https://mcp.example:8443/mcp): refused",
            ),
            (
                "at http://127.0.0.1:9/v1?key=abc.",
                "at http://127.0.0.1:9/v1.",
            ),
            ("no url here", "no url here"),
            ("weird://", "weird://"),
        ];
        for (input, expected) in cases {
            assert_eq!(endpoints_only(input), expected, "{input}");
        }
        assert_eq!(endpoint("http://a:b@h/p?q=1"), "http://h/p");
        assert_eq!(endpoint("not a url"), "[url]");
        let e = std::io::Error::other("cannot reach https://h/x?token=s3cr3t");
        assert_eq!(outbound_error(&e), "cannot reach https://h/x");
    }

    #[test]
    fn each_pattern_is_redacted() {
        let r = Redactor::new(&["ACME-\\d+".to_string()]).unwrap();
        let cases = [
            ("mail ada@example.com now", "mail [email] now"),
            ("call +1 (415) 555-0100 today", "call [phone] today"),
            ("id 11010519491231002X ok", "id [id_card] ok"),
            ("card 4111111111111111 ok", "card [bank_card] ok"),
            ("card 4111 1111 1111 1111 ok", "card [bank_card] ok"),
            ("auth Bearer abcDEF123456789xyz", "auth [bearer]"),
            ("key sk-proj1234567890abcdefXYZ end", "key [api_key] end"),
            ("slack xoxb-1234567890-abcdef", "slack [api_key]"),
            ("ticket ACME-42 open", "ticket [custom0] open"),
            (
                "url http://api/bot123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw/sendMessage",
                "url http://api/bot[bot_token]/sendMessage",
            ),
            (
                "GET /cgi-bin/gettoken?corpid=ww1&corpsecret=s3cr3t-VALUE&x=1",
                "GET /cgi-bin/gettoken?corpid=ww1&corpsecret=[secret]&x=1",
            ),
            (
                "at https://bob:hunter22@h.example/x",
                "at https://[credentials]h.example/x",
            ),
            ("auth Basic YWxhZGRpbjpvcGVuc2VzYW1l", "auth [basic]"),
            (
                "jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig-abc_123 end",
                "jwt [jwt] end",
            ),
            ("?access_token=abc123&ok=1", "?access_token=[secret]&ok=1"),
        ];
        for (input, expected) in cases {
            assert_eq!(r.redact(input), expected, "{input}");
        }
        assert_eq!(
            r.redact("nothing secret here, task 42"),
            "nothing secret here, task 42"
        );
        assert!(
            Redactor::new(&["(".to_string()])
                .unwrap_err()
                .contains("extra_patterns[0]")
        );
    }
}

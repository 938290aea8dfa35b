//! The expression language of workflows and tool calls: minijinja (Jinja2 syntax) with the
//! Python-style methods people write in Jinja (`startswith`, `lower`, `split`, … through
//! minijinja-contrib's pycompat callback) and strict undefined values, so a typo fails
//! loudly instead of rendering as nothing. Also the dry run that publishing a workflow uses
//! to refuse an expression calling a function, method, filter or test that does not exist.
//! Never reaches the network or the database.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use minijinja::value::{Enumerator, Object, ObjectRepr, Serde};
use minijinja::{Environment, ErrorKind, UndefinedBehavior, Value};

fn build(undefined: UndefinedBehavior) -> Environment<'static> {
    let mut env = Environment::new();
    env.set_undefined_behavior(undefined);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env
}

/// The environment every run renders and evaluates with (built once: this is the step path).
fn environment() -> &'static Environment<'static> {
    static ENV: OnceLock<Environment<'static>> = OnceLock::new();
    ENV.get_or_init(|| build(UndefinedBehavior::Strict))
}

/// Renders a `{{ … }}` template against `context`; plain strings pass through unchanged.
pub fn render(template: &str, context: &serde_json::Value) -> Result<String, minijinja::Error> {
    if !template.contains("{{") && !template.contains("{%") {
        return Ok(template.to_string());
    }
    environment().render_str(template, Serde(context))
}

/// Where in a URL a value is placed.
#[derive(Clone, Copy, PartialEq)]
enum UrlPart {
    Path,
    Query,
}

/// Everything but unreserved characters (RFC 3986: letters, digits, `-._~`) is encoded.
const COMPONENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

fn encode(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, COMPONENT).to_string()
}

/// An environment whose `{{ … }}` output is percent-encoded for `part` of a URL; in a path a
/// value holding `/`, `?`, `#` or `..` is refused (encoded or not, servers and URL parsers may
/// still read it as a path step). `| safe` opts a value out, and `| urlencode` marks its
/// (encoded) output safe so it is not encoded twice.
fn url_environment(part: UrlPart, undefined: UndefinedBehavior) -> Environment<'static> {
    let mut env = build(undefined);
    env.add_filter("urlencode", |value: Value| {
        Value::from_safe_string(encode(&value.to_string()))
    });
    env.set_formatter(move |out, state, value| {
        if value.is_safe() || value.is_undefined() {
            return minijinja::escape_formatter(out, state, value);
        }
        let text = value.to_string();
        if part == UrlPart::Path && (text.contains(['/', '?', '#']) || text.contains("..")) {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("`{text}` may not be placed in a URL path (it holds /, ?, # or ..)"),
            ));
        }
        out.write_str(&encode(&text))
            .map_err(|e| minijinja::Error::new(ErrorKind::WriteFailure, e.to_string()))
    });
    env
}

/// Splits a URL template at its first `?` outside `{{ … }}` / `{% … %}`: path and query.
fn split_url_template(template: &str) -> (&str, &str) {
    let bytes = template.as_bytes();
    let mut depth = 0usize;
    let mut i = 0;
    while i < bytes.len() {
        match (bytes[i], bytes.get(i + 1)) {
            (b'{', Some(b'{' | b'%')) => {
                depth += 1;
                i += 2;
                continue;
            }
            (b'}' | b'%', Some(b'}')) if depth > 0 => {
                depth -= 1;
                i += 2;
                continue;
            }
            (b'?', _) if depth == 0 => return template.split_at(i),
            _ => {}
        }
        i += 1;
    }
    (template, "")
}

fn url_environments(undefined: UndefinedBehavior) -> [Environment<'static>; 2] {
    [
        url_environment(UrlPart::Path, undefined),
        url_environment(UrlPart::Query, undefined),
    ]
}

/// Renders a tool's URL template: values placed in the path or the query are percent-encoded
/// (`| safe` opts out), and a path value holding `/`, `?`, `#` or `..` is refused, so chat
/// text cannot reach another path of the tool's host.
pub fn render_url(template: &str, context: &serde_json::Value) -> Result<String, minijinja::Error> {
    static ENVS: OnceLock<[Environment<'static>; 2]> = OnceLock::new();
    let [path_env, query_env] = ENVS.get_or_init(|| url_environments(UndefinedBehavior::Strict));
    let (path, query) = split_url_template(template);
    let mut url = path_env.render_str(path, Serde(context))?;
    if !query.is_empty() {
        url.push_str(&query_env.render_str(query, Serde(context))?);
    }
    Ok(url)
}

/// As [`dry_run_template`], for a tool's URL template.
pub fn dry_run_url(template: &str, sample: &Value) -> Result<(), String> {
    static ENVS: OnceLock<[Environment<'static>; 2]> = OnceLock::new();
    let [path_env, query_env] = ENVS.get_or_init(|| url_environments(UndefinedBehavior::Chainable));
    let (path, query) = split_url_template(template);
    for (env, part) in [(path_env, path), (query_env, query)] {
        let compiled = env.template_from_str(part).map_err(|e| e.to_string())?;
        compiled
            .render(sample)
            .map(|_| ())
            .or_else(unknown_callable)?;
    }
    Ok(())
}

/// Evaluates a condition (`steps.review.text.startswith('TERMINATE')`) to true or false.
pub fn is_true(expression: &str, context: &serde_json::Value) -> Result<bool, minijinja::Error> {
    let expr = environment().compile_expression(expression)?;
    Ok(expr.eval(Serde(context))?.is_true())
}

/// A stand-in for a value only known at run time (a tool's output): every field is a
/// string, so string methods and filters resolve; nothing is enumerated.
#[derive(Debug)]
struct Sample;

impl Object for Sample {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, _key: &Value) -> Option<Value> {
        Some(Value::from("sample"))
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Empty
    }
}

/// The context a dry run evaluates against: the message's fields as strings, for each node
/// id its output (`text` for model nodes, anything for the others), and a sample exchange
/// as `history`.
pub fn sample_context(nodes: &[(String, bool)]) -> Value {
    let map = |pairs: Vec<(String, Value)>| Value::from(BTreeMap::from_iter(pairs));
    let steps = nodes
        .iter()
        .map(|(id, model_node)| {
            let value = if *model_node {
                map(vec![("text".into(), Value::from("sample answer"))])
            } else {
                Value::from_object(Sample)
            };
            (id.clone(), value)
        })
        .collect();
    let message = [
        "text",
        "sender_id",
        "sender_name",
        "conversation_id",
        "message_id",
    ]
    .map(|k| (k.to_string(), Value::from("sample")));
    let exchange = ["user", "assistant"].map(|role| {
        map(vec![
            ("role".into(), Value::from(role)),
            ("text".into(), Value::from("sample")),
        ])
    });
    map(vec![
        ("message".into(), map(message.to_vec())),
        ("steps".into(), map(steps)),
        ("history".into(), Value::from(exchange.to_vec())),
    ])
}

/// The context a tool's URL, headers and body are dry-run against: `args` and `result`
/// (undo calls) as values known only at run time.
pub fn tool_sample_context() -> Value {
    Value::from(BTreeMap::from_iter([
        ("args".to_string(), Value::from_object(Sample)),
        ("result".to_string(), Value::from_object(Sample)),
    ]))
}

/// Only a call of something that does not exist fails a dry run: the sample values cannot
/// stand for every real one, so type errors and the like are left to run time.
fn unknown_callable(e: minijinja::Error) -> Result<(), String> {
    match e.kind() {
        ErrorKind::UnknownFilter
        | ErrorKind::UnknownFunction
        | ErrorKind::UnknownMethod
        | ErrorKind::UnknownTest => Err(e.to_string()),
        _ => Ok(()),
    }
}

fn dry_run_environment() -> &'static Environment<'static> {
    static ENV: OnceLock<Environment<'static>> = OnceLock::new();
    ENV.get_or_init(|| build(UndefinedBehavior::Chainable))
}

/// Parses `template` and renders it against `sample` (see [`sample_context`]); refuses a
/// syntax error or a call of an unknown function, method, filter or test.
pub fn dry_run_template(template: &str, sample: &Value) -> Result<(), String> {
    let env = dry_run_environment();
    let compiled = env.template_from_str(template).map_err(|e| e.to_string())?;
    compiled
        .render(sample)
        .map(|_| ())
        .or_else(unknown_callable)
}

/// As [`dry_run_template`], for a condition expression.
pub fn dry_run_expression(expression: &str, sample: &Value) -> Result<(), String> {
    let env = dry_run_environment();
    let expr = env
        .compile_expression(expression)
        .map_err(|e| e.to_string())?;
    expr.eval(sample).map(|_| ()).or_else(unknown_callable)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn python_style_string_methods_work_in_conditions_and_templates() {
        let ctx = json!({ "steps": { "review": { "text": "  TERMINATE: breach " } } });
        for (expr, want) in [
            ("steps.review.text.strip().startswith('TERMINATE')", true),
            ("steps.review.text.lower().strip().endswith('breach')", true),
            ("'breach' in steps.review.text", true),
            ("steps.review.text.upper().startswith('KEEP')", false),
            (
                "steps.review.text.split(':')[0].strip() == 'TERMINATE'",
                true,
            ),
            (
                "steps.review.text.replace('TERMINATE', 'KEEP').strip().startswith('KEEP')",
                true,
            ),
        ] {
            assert_eq!(is_true(expr, &ctx).unwrap(), want, "{expr}");
        }
        assert_eq!(
            render("{{ steps.review.text.strip().lower() }}", &ctx).unwrap(),
            "terminate: breach"
        );
    }

    #[test]
    fn url_values_are_encoded_and_path_escapes_refused() {
        let ctx = json!({ "args": { "id": "C 7&x=1", "q": "a/b?c#d", "up": "../../admin", "raw": "a/b" } });
        let url =
            "https://h.example/api/{{ args.id }}/notes?q={{ args.q }}&k={{ args.q | urlencode }}";
        assert_eq!(
            render_url(url, &ctx).unwrap(),
            "https://h.example/api/C%207%26x%3D1/notes?q=a%2Fb%3Fc%23d&k=a%2Fb%3Fc%23d"
        );
        for attack in ["{{ args.up }}", "{{ args.q }}", "x{{ args.raw }}"] {
            let err = render_url(&format!("https://h.example/api/{attack}"), &ctx).unwrap_err();
            assert!(
                err.to_string().contains("may not be placed in a URL path"),
                "{err}"
            );
        }
        assert_eq!(
            render_url("https://h.example/{{ args.raw | safe }}", &ctx).unwrap(),
            "https://h.example/a/b"
        );
        let sample = sample_context(&[]);
        assert!(dry_run_url("https://h/{{ message.text | shout }}", &sample).is_err());
        dry_run_url(
            "https://h/{{ message.text }}?q={{ message.text | urlencode }}",
            &sample,
        )
        .unwrap();
    }

    #[test]
    fn a_dry_run_refuses_what_does_not_exist_and_accepts_unknown_data() {
        let sample = sample_context(&[("review".into(), true), ("fetch".into(), false)]);
        dry_run_expression("steps.review.text.startswith('TERMINATE')", &sample).unwrap();
        dry_run_template("{{ steps.fetch | tojson }} {{ steps.fetch.id }}", &sample).unwrap();
        dry_run_expression("steps.fetch.status == 'open'", &sample).unwrap();
        let method = dry_run_expression("steps.review.text.beginswith('X')", &sample).unwrap_err();
        assert!(
            method.contains("beginswith") || method.contains("method"),
            "{method}"
        );
        assert!(dry_run_template("{{ message.text | shout }}", &sample).is_err());
        assert!(dry_run_template("{{ nothing_here() }}", &sample).is_err());
        assert!(dry_run_expression("message.text is palindrome", &sample).is_err());
        assert!(dry_run_template("{{ message.text ", &sample).is_err());
    }
}

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

/// The context a dry run evaluates against: the message's fields as strings, and for each
/// node id its output (`text` for model nodes, anything for the others).
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
    map(vec![
        ("message".into(), map(message.to_vec())),
        ("steps".into(), map(steps)),
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

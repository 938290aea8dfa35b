//! Card rendering: each platform's cards are minijinja templates in
//! `templates/cards/<platform>/<card_type>.json` (compiled into the binary), rendered over
//! `card` (the card JSON), `text` (its text fallback) and `key` (the reply key). A card type
//! a platform has no template for goes out as its text fallback.

use serde_json::{Value, json};

/// `(platform, card type, template)`, read from `templates/cards/` at compile time.
macro_rules! card {
    ($platform:literal, $card_type:literal) => {
        (
            $platform,
            $card_type,
            include_str!(concat!(
                "../../templates/cards/",
                $platform,
                "/",
                $card_type,
                ".json"
            )),
        )
    };
}

const TEMPLATES: &[(&str, &str, &str)] = &[
    card!("slack", "approval_request"),
    card!("slack", "knowledge_answer"),
    card!("slack", "agent_result"),
    card!("telegram", "approval_request"),
    card!("lark", "approval_request"),
    card!("lark", "knowledge_answer"),
    card!("lark", "agent_result"),
    card!("wecom", "approval_request"),
    card!("dingtalk", "approval_request"),
    card!("dingtalk", "knowledge_answer"),
    card!("dingtalk", "agent_result"),
    card!("matrix", "approval_request"),
];

/// Renders `card` for `platform`; `None` when the platform has no template for its type.
pub fn render(
    platform: &str,
    card: &Value,
    text: &str,
    key: &str,
) -> Result<Option<Value>, String> {
    let card_type = card.get("card_type").and_then(Value::as_str).unwrap_or("");
    let Some((_, _, template)) = TEMPLATES
        .iter()
        .find(|(p, t, _)| *p == platform && *t == card_type)
    else {
        return Ok(None);
    };
    let mut env = minijinja::Environment::new();
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Chainable);
    let rendered = env
        .render_str(
            template,
            minijinja::value::Serde(json!({ "card": card, "text": text, "key": key })),
        )
        .map_err(|e| format!("card template {platform}/{card_type}: {e}"))?;
    serde_json::from_str(&rendered)
        .map(Some)
        .map_err(|e| format!("card template {platform}/{card_type} did not render JSON: {e}"))
}

/// The request an approval card asks about, read from its stored reply's content (a
/// reaction to it is a decision on that request; see `control::reaction_decision`).
pub fn approval_of(reply_content: &str) -> Option<crate::domain::ApprovalRef> {
    let content: Value = serde_json::from_str(reply_content).ok()?;
    if content["card"]["card_type"] != "approval_request" {
        return None;
    }
    crate::domain::ApprovalRef::from_card_value(&content["card"]["actions"][0]["value"])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_template_renders_json() {
        let card = json!({
            "card_type": "approval_request", "title": "Approval needed", "message": "Run \"x\"?",
            "actions": [
                {"id": "approve", "value": {"task_id": 1, "step_no": 2, "decision": "approve"}},
                {"id": "reject", "value": {"task_id": 1, "step_no": 2, "decision": "reject"}}
            ]
        });
        for (platform, card_type, _) in TEMPLATES {
            let mut c = card.clone();
            c["card_type"] = json!(card_type);
            let out = render(platform, &c, "fallback", "agent-task-1").unwrap();
            assert!(out.is_some(), "{platform}/{card_type}");
        }
        assert!(
            render("slack", &json!({"card_type": "nope"}), "t", "k")
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn knowledge_answers_show_their_sources() {
        let card = json!({
            "card_type": "knowledge_answer", "title": "Travel", "answer": "Economy \"only\" [1].",
            "sources": [
                {"n": 1, "title": "Travel policy", "heading": "Flights", "url": "https://intranet.example/travel"},
                {"n": 2, "title": "报销制度", "heading": ""}
            ]
        });
        for platform in ["slack", "lark", "dingtalk"] {
            let out = render(platform, &card, "fallback", "k").unwrap().unwrap();
            let shown = out.to_string();
            assert!(
                shown.contains("[1] Travel policy — Flights"),
                "{platform}: {shown}"
            );
            assert!(
                shown.contains("https://intranet.example/travel"),
                "{platform}: {shown}"
            );
            assert!(shown.contains("[2] 报销制度"), "{platform}: {shown}");
        }
        // Without sources, no sources block.
        let bare = json!({"card_type": "knowledge_answer", "answer": "A"});
        for platform in ["slack", "lark", "dingtalk"] {
            let shown = render(platform, &bare, "A", "k")
                .unwrap()
                .unwrap()
                .to_string();
            assert!(
                !shown.contains("Sources") && !shown.contains("context"),
                "{platform}: {shown}"
            );
        }
    }
}

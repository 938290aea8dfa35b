//! Tool arguments are checked against each tool's `args_schema` with the `jsonschema` crate
//! (the whole of JSON Schema: types, `required`, `properties`, `enum`, `pattern`,
//! `maxLength`, …), compiled once when the registry is built. The message names where the
//! arguments are wrong, so a model can correct its call.

use serde_json::Value;

/// A compiled `args_schema`.
pub struct ArgsSchema(jsonschema::Validator);

impl ArgsSchema {
    /// Compiles `schema`; an invalid schema is refused with the reason.
    pub fn compile(schema: &Value) -> Result<ArgsSchema, String> {
        jsonschema::validator_for(schema)
            .map(ArgsSchema)
            .map_err(|e| format!("not a valid JSON Schema: {e}"))
    }

    /// `Err` names the first place the arguments break the schema.
    pub fn check(&self, args: &Value) -> Result<(), String> {
        self.0.validate(args).map_err(|e| {
            let at = e.instance_path().as_str();
            if at.is_empty() {
                format!("arguments: {e}")
            } else {
                format!("arguments{at}: {e}")
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn checks_required_types_patterns_and_lengths() {
        let schema = ArgsSchema::compile(
            &json!({"type": "object", "required": ["id"], "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]-[0-9]+$", "maxLength": 8},
            "n": {"type": "integer"}}}),
        )
        .unwrap();
        assert!(schema.check(&json!({"id": "T-42"})).is_ok());
        assert!(schema.check(&json!({})).unwrap_err().contains("\"id\""));
        assert!(
            schema
                .check(&json!({"id": 1}))
                .unwrap_err()
                .contains("arguments/id")
        );
        assert!(schema.check(&json!({"id": "T-42", "n": 1.5})).is_err());
        assert!(schema.check(&json!("str")).is_err());
        assert!(schema.check(&json!({"id": "../admin"})).is_err(), "pattern");
        assert!(
            schema.check(&json!({"id": "T-123456789"})).is_err(),
            "maxLength"
        );
        assert!(ArgsSchema::compile(&json!({"type": 7})).is_err());
    }
}

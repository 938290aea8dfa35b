//! The subset of JSON Schema tool arguments are checked against: `type` (object, string,
//! number, integer, boolean, array), `required`, `properties` and `enum`, nested. Enough to
//! refuse a malformed model-made call with a message the model can act on.

use serde_json::Value;

pub fn validate(schema: &Value, value: &Value) -> Result<(), String> {
    check(schema, value, "arguments")
}

fn check(schema: &Value, value: &Value, at: &str) -> Result<(), String> {
    if let Some(expected) = schema.get("type").and_then(Value::as_str) {
        let ok = match expected {
            "object" => value.is_object(),
            "string" => value.is_string(),
            "number" => value.is_number(),
            "integer" => value.is_i64() || value.is_u64(),
            "boolean" => value.is_boolean(),
            "array" => value.is_array(),
            "null" => value.is_null(),
            _ => true,
        };
        if !ok {
            return Err(format!("{at} must be of type {expected}"));
        }
    }
    if let Some(options) = schema.get("enum").and_then(Value::as_array)
        && !options.contains(value)
    {
        return Err(format!(
            "{at} must be one of {}",
            Value::Array(options.clone())
        ));
    }
    if let Some(object) = value.as_object() {
        if let Some(required) = schema.get("required").and_then(Value::as_array) {
            for field in required.iter().filter_map(Value::as_str) {
                if !object.contains_key(field) {
                    return Err(format!("{at} is missing `{field}`"));
                }
            }
        }
        if let Some(properties) = schema.get("properties").and_then(Value::as_object) {
            for (name, sub) in properties {
                if let Some(v) = object.get(name) {
                    check(sub, v, &format!("{at}.{name}"))?;
                }
            }
        }
    }
    if let (Some(items), Some(array)) = (schema.get("items"), value.as_array()) {
        for (i, v) in array.iter().enumerate() {
            check(items, v, &format!("{at}[{i}]"))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn checks_required_and_types() {
        let schema = json!({"type": "object", "required": ["id"], "properties": {"id": {"type": "string"}, "n": {"type": "integer"}}});
        assert!(validate(&schema, &json!({"id": "x"})).is_ok());
        assert!(validate(&schema, &json!({})).unwrap_err().contains("`id`"));
        assert!(
            validate(&schema, &json!({"id": 1}))
                .unwrap_err()
                .contains("arguments.id")
        );
        assert!(validate(&schema, &json!({"id": "x", "n": 1.5})).is_err());
        assert!(validate(&schema, &json!("str")).is_err());
    }
}

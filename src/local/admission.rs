//! What the API server checks at `kubectl apply`, without one: the CustomResourceDefinition's OpenAPI schema (types,
//! required fields, enums, bounds, patterns, defaults) and its CEL rules (`x-kubernetes-validations`), read from the
//! CRD that `pelican crd` prints, so a file refused here is refused by the cluster with the same message.
//!
//! As in the API server, the CEL rules run after the schema, unless the schema found a wrong type, a missing field, a
//! value outside an enum or a string too long; transition rules (those that read `oldSelf`) are skipped, as at
//! creation.

use std::collections::HashMap;
use std::sync::Arc;

use kube::CustomResourceExt;
use serde_json::{Map, Value};

use crate::api::ConsumerGroupPolicy;

/// The schema of `spec`, as the CRD holds it.
fn spec_schema() -> Value {
    let crd = serde_json::to_value(ConsumerGroupPolicy::crd()).expect("the CRD serializes");
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"].clone()
}

/// Checks `spec` as the API server would and fills in the schema's defaults, as it does before its checks. Each
/// error reads as the API server words it: `<field>: <what is wrong>`.
pub fn admit_spec(spec: &mut Value) -> Result<(), Vec<String>> {
    let schema = spec_schema();
    let mut errors = Errors::default();
    check(&schema, spec, "spec", &mut errors);
    let mut errors = match errors.blocking {
        true => {
            let skipped = "some validation rules were not checked because the object was invalid; correct the \
                           existing errors to complete validation";
            errors.list.push(skipped.to_string());
            errors.list
        }
        false => {
            let mut list = errors.list;
            check_rules(&schema, spec, "spec", &mut list);
            list
        }
    };
    errors.dedup();
    if errors.is_empty() { Ok(()) } else { Err(errors) }
}

/// What the schema found, and whether any of it keeps the CEL rules from running.
#[derive(Default)]
struct Errors {
    list: Vec<String>,
    blocking: bool,
}

impl Errors {
    fn push(&mut self, error: String) {
        self.list.push(error);
    }

    fn blocking(&mut self, error: String) {
        self.list.push(error);
        self.blocking = true;
    }
}

fn check(schema: &Value, value: &mut Value, path: &str, errors: &mut Errors) {
    if value.is_null() && schema["nullable"] == true {
        return;
    }
    let type_ = schema["type"].as_str();
    let fits = match type_ {
        Some("object") => value.is_object(),
        Some("array") => value.is_array(),
        Some("string") => value.is_string(),
        Some("integer") => value.is_i64() || value.is_u64(),
        Some("number") => value.is_number(),
        Some("boolean") => value.is_boolean(),
        _ => true,
    };
    if !fits {
        let type_ = type_.unwrap_or_default();
        errors.blocking(format!("{path}: Invalid value: {value}: {path} in body must be of type {type_}"));
        return;
    }
    if let Some(allowed) = schema["enum"].as_array()
        && !allowed.contains(value)
    {
        let supported = allowed.iter().map(Value::to_string).collect::<Vec<_>>().join(", ");
        errors.blocking(format!("{path}: Unsupported value: {value}: supported values: {supported}"));
    }
    match value {
        Value::Object(fields) => check_object(schema, fields, path, errors),
        Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                check(&schema["items"], item, &format!("{path}[{i}]"), errors);
            }
        }
        Value::String(text) => check_string(schema, text, path, errors),
        Value::Number(number) => {
            let n = number.as_f64().unwrap_or_default();
            if let Some(min) = schema["minimum"].as_f64()
                && n < min
            {
                errors.push(format!(
                    "{path}: Invalid value: {number}: {path} in body should be greater than or equal to {min}"
                ));
            }
            if let Some(max) = schema["maximum"].as_f64()
                && n > max
            {
                errors.push(format!(
                    "{path}: Invalid value: {number}: {path} in body should be less than or equal to {max}"
                ));
            }
        }
        _ => {}
    }
}

fn check_object(schema: &Value, fields: &mut Map<String, Value>, path: &str, errors: &mut Errors) {
    let properties = schema["properties"].as_object();
    if let Some(properties) = properties {
        for (name, property) in properties {
            if let (false, Some(default)) = (fields.contains_key(name), property.get("default")) {
                fields.insert(name.clone(), default.clone());
            }
        }
    }
    for required in schema["required"].as_array().into_iter().flatten().filter_map(Value::as_str) {
        if !fields.contains_key(required) {
            errors.blocking(format!("{path}.{required}: Required value"));
        }
    }
    let open = schema["x-kubernetes-preserve-unknown-fields"] == true;
    for (name, field) in fields.iter_mut() {
        let child = format!("{path}.{name}");
        match (properties.and_then(|p| p.get(name)), schema.get("additionalProperties")) {
            (Some(property), _) => check(property, field, &child, errors),
            (None, Some(additional)) if additional.is_object() => check(additional, field, &child, errors),
            (None, _) if open || properties.is_none() => {}
            (None, _) => errors.push(format!("{child}: unknown field {name:?} (strict decoding error)")),
        }
    }
}

fn check_string(schema: &Value, text: &str, path: &str, errors: &mut Errors) {
    let length = text.chars().count() as u64;
    if let Some(min) = schema["minLength"].as_u64()
        && length < min
    {
        errors.push(format!("{path}: Invalid value: {text:?}: {path} in body should be at least {min} chars long"));
    }
    if let Some(max) = schema["maxLength"].as_u64()
        && length > max
    {
        errors.blocking(format!("{path}: Too long: may not be more than {max} bytes"));
    }
    if let Some(pattern) = schema["pattern"].as_str() {
        match regex::Regex::new(pattern) {
            Ok(re) if re.is_match(text) => {}
            Ok(_) => {
                errors.push(format!("{path}: Invalid value: {text:?}: {path} in body should match '{pattern}'"));
            }
            Err(e) => errors.push(format!("{path}: the schema's pattern {pattern:?} does not compile: {e}")),
        }
    }
}

/// The `x-kubernetes-validations` of the node and of every node below it, each with `self` that node's value.
fn check_rules(schema: &Value, value: &Value, path: &str, errors: &mut Vec<String>) {
    match value {
        Value::Object(fields) => {
            for (name, field) in fields {
                let property = schema["properties"].get(name).or_else(|| schema.get("additionalProperties"));
                if let Some(property) = property.filter(|p| p.is_object()) {
                    check_rules(property, field, &format!("{path}.{name}"), errors);
                }
            }
        }
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                check_rules(&schema["items"], item, &format!("{path}[{i}]"), errors);
            }
        }
        _ => {}
    }
    let rules = schema["x-kubernetes-validations"].as_array().into_iter().flatten();
    for rule in rules {
        let Some(expression) = rule["rule"].as_str() else { continue };
        if expression.contains("oldSelf") {
            continue;
        }
        let at = match rule["fieldPath"].as_str() {
            Some(field) => format!("{path}{field}"),
            None => path.to_string(),
        };
        let message = rule["message"].as_str().map_or_else(|| format!("failed rule: {expression}"), str::to_string);
        match evaluate(expression, value) {
            Ok(true) => {}
            Ok(false) => errors.push(format!("{at}: Invalid value: {:?}: {message}", type_name(value))),
            Err(e) => {
                errors.push(format!("{at}: Invalid value: {:?}: {e} evaluating rule: {expression}", type_name(value)))
            }
        }
    }
}

/// How the API server names the type of the value a rule failed on.
fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Object(_) => "object",
        Value::Array(_) => "array",
        Value::String(_) => "string",
        Value::Number(n) if n.is_f64() => "number",
        Value::Number(_) => "integer",
        Value::Bool(_) => "boolean",
        Value::Null => "null",
    }
}

fn evaluate(expression: &str, value: &Value) -> Result<bool, String> {
    let program = cel::Program::compile(expression).map_err(|e| e.to_string())?;
    let mut context = cel::Context::default();
    context.add_variable_from_value("self", to_cel(value));
    match program.execute(&context).map_err(|e| e.to_string())? {
        cel::Value::Bool(result) => Ok(result),
        other => Err(format!("the rule gave {other:?}, not a boolean")),
    }
}

/// A JSON value as CEL sees it: integers are `int`, as in the API server.
fn to_cel(value: &Value) -> cel::Value {
    match value {
        Value::Null => cel::Value::Null,
        Value::Bool(b) => cel::Value::Bool(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => cel::Value::Int(i),
            None => cel::Value::Float(n.as_f64().unwrap_or_default()),
        },
        Value::String(s) => cel::Value::String(Arc::new(s.clone())),
        Value::Array(items) => cel::Value::List(Arc::new(items.iter().map(to_cel).collect())),
        Value::Object(fields) => {
            let map: HashMap<String, cel::Value> = fields.iter().map(|(k, v)| (k.clone(), to_cel(v))).collect();
            cel::Value::from(map)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(extra: Value) -> Value {
        let mut spec = serde_json::json!({
            "redis": {"url": "redis://127.0.0.1:6379/0"}, "stream": "orders", "group": "billing",
            "deadLetter": {"stream": "orders:dlq"},
        });
        spec.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        spec
    }

    fn refused(extra: Value) -> String {
        admit_spec(&mut spec(extra)).unwrap_err().join("\n")
    }

    #[test]
    fn a_valid_spec_is_admitted_and_defaulted_its_transition_rules_skipped() {
        let mut spec = spec(serde_json::json!({}));
        admit_spec(&mut spec).unwrap();
        assert_eq!(spec["reclaim"]["minIdle"], "5m", "{spec}");
        assert_eq!(spec["redis"]["mode"], "Standalone", "{spec}");
    }

    #[test]
    fn a_cel_rule_refuses_with_its_message() {
        let out = refused(serde_json::json!({"deadLetter": {"stream": "orders"}}));
        assert!(
            out.contains("spec.deadLetter.stream: Invalid value: \"object\": spec.deadLetter.stream must differ"),
            "{out}"
        );
        let out = refused(serde_json::json!({"reclaim": {"minIdle": "0s"}}));
        assert!(out.contains("spec.reclaim.minIdle must be at least 1s"), "{out}");
        let out = refused(serde_json::json!({"redis": {"url": "redis://:hunter2@127.0.0.1:6379/0"}}));
        assert!(out.contains("spec.redis.url must not contain credentials"), "{out}");
    }

    #[test]
    fn the_schema_refuses_bounds_patterns_types_and_unknown_fields() {
        let out = refused(serde_json::json!({"retry": {"maxDeliveries": 0}}));
        assert!(out.contains("spec.retry.maxDeliveries: Invalid value: 0: spec.retry.maxDeliveries in body should be greater than or equal to 1"), "{out}");
        let out = refused(serde_json::json!({"reclaim": {"interval": "5 minutes"}}));
        assert!(out.contains("spec.reclaim.interval: Invalid value: \"5 minutes\""), "{out}");
        let out = refused(serde_json::json!({"retry": {"maxDeliveries": "two"}}));
        assert!(out.contains("must be of type integer"), "{out}");
        let out = refused(serde_json::json!({"retyr": {}}));
        assert!(out.contains("spec.retyr: unknown field"), "{out}");
        let out = admit_spec(&mut serde_json::json!({"stream": "s"})).unwrap_err().join("\n");
        assert!(out.contains("spec.redis: Required value") && out.contains("spec.group: Required value"), "{out}");
        assert!(out.contains("some validation rules were not checked"), "{out}");
    }
}

//! Small readers for XINFO-style replies (flat key/value arrays in RESP2, maps in RESP3).

use std::collections::HashMap;

use redis::{FromRedisValue, Value};

pub type Fields = HashMap<String, Value>;

pub fn fields(value: Value) -> Option<Fields> {
    redis::from_redis_value(value).ok()
}

/// A field decoded as `T`; `None` when missing, nil or of another shape.
pub fn get<T: FromRedisValue>(fields: &Fields, name: &str) -> Option<T> {
    match fields.get(name)? {
        Value::Nil => None,
        value => redis::from_redis_value_ref(value).ok(),
    }
}

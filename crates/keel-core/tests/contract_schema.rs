//! `schema/contract.schema.json` at the workspace root is generated from the contract's raw
//! types. This test keeps it current: run it with `KEEL_BLESS=1` to rewrite the file.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::path::Path;

#[test]
fn schema_file_is_current() {
    // CARGO_MANIFEST_DIR is crates/keel-core; the schema lives at the workspace root.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap();
    let path = root.join("schema/contract.schema.json");
    let generated = keel_core::contract::json_schema();
    if std::env::var_os("KEEL_BLESS").is_some() {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, &generated).unwrap();
        return;
    }
    let on_disk = fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == generated,
        "{} is out of date with the contract types; run \
         `KEEL_BLESS=1 cargo test -p keel-core --test contract_schema` to rewrite it, then review \
         the diff",
        path.display()
    );
}

#[test]
fn schema_describes_the_contract() {
    let schema: serde_json::Value =
        serde_json::from_str(&keel_core::contract::json_schema()).unwrap();
    assert_eq!(schema["title"], "keel contract");
    assert_eq!(
        schema["additionalProperties"], false,
        "unknown keys are errors"
    );
    assert_eq!(schema["required"], serde_json::json!(["task"]));
    let properties = schema["properties"].as_object().unwrap();
    let keys: Vec<&str> = properties.keys().map(String::as_str).collect();
    for key in [
        "task",
        "workspace",
        "driver",
        "scope",
        "budget",
        "verify",
        "phase",
        "tool",
    ] {
        assert!(keys.contains(&key), "schema lacks `{key}`: {keys:?}");
    }
    assert!(keel_core::contract::json_schema().ends_with("}\n"));
}

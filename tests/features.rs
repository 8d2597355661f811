//! What a server can do, detected per command: `status.serverFeatures` on each server of the matrix, and a server
//! without Lua scripting refused before anything is written.

#[macro_use]
mod common;

use common::*;

on_every_server!(the_status_lists_what_the_server_can_do);

fn the_status_lists_what_the_server_can_do(flavor: Flavor) {
    let server = Server::start(flavor);
    let (ns, _operator) = ready_policy("features", &policy("p", &server.url(), "s", "g", ""), "p");
    let status = get_policy(&ns, "p")["status"].clone();
    let features: Vec<&str> =
        status["serverFeatures"].as_array().map(|f| f.iter().filter_map(|v| v.as_str()).collect()).unwrap_or_default();
    println!("{flavor:?} ({}): serverFeatures {features:?}", status["serverVersion"]);
    let expected: &[&str] = match flavor {
        Flavor::Redis82 => &["XACKDEL", "XDELEX", "XTRIM ACKED"],
        // 8.4 added reads that claim, 8.6 idempotent production; XNACK is 8.8's.
        Flavor::Redis86 => &["XACKDEL", "XADD IDMP", "XDELEX", "XREADGROUP CLAIM", "XTRIM ACKED"],
        _ => &[],
    };
    assert_eq!(features, expected);
}

/// `EVAL` and `EVALSHA` renamed away (as on a Valkey built without its Lua module, where they are unknown commands):
/// Stalled `ScriptingUnavailable`, and the group is not created.
#[test]
fn a_server_without_scripting_is_refused_before_any_write() {
    let server =
        Server::start_with(Flavor::Redis, &["--rename-command", "EVAL", "", "--rename-command", "EVALSHA", ""]);
    let ns = namespace("noscripting");
    let _operator = Operator::start(&ns);
    assert!(kubectl_apply(&ns, &policy("p", &server.url(), "s", "g", "")).0);
    let policy = wait_condition(&ns, "p", "Stalled", "True", "ScriptingUnavailable");
    let ready = policy["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Ready").unwrap();
    println!("Ready: {} {}", ready["reason"], ready["message"]);
    assert!(ready["message"].as_str().unwrap().contains("has no Lua scripting"), "{ready}");
    let exists: i64 = redis::cmd("EXISTS").arg("s").query(&mut server.conn()).unwrap();
    assert_eq!(exists, 0, "nothing written");
}

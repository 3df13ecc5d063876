//! `labsync warm NAME --nodes gpu3,gpu4 | --all [--unpin]`: an admin has the
//! cluster's coordinator fetch a version into those nodes' caches now and
//! pin it there, and watches each node's progress until all are done.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Result};
use labsync_agent::cluster::{WarmAnswer, WarmAsk};
use labsync_agent::proto::NodeName;
use serde_json::json;

use super::{explain_client, Printer};
use crate::{human_bytes, Settings};

/// What was asked.
pub struct WarmArgs {
    /// `NAME` or `NAME@vN`.
    pub name: String,
    /// Nodes; empty with `all`.
    pub nodes: Vec<NodeName>,
    /// Every node that is up.
    pub all: bool,
    /// Release the pin instead.
    pub unpin: bool,
    /// The coordinator's address.
    pub labd: Option<String>,
}

/// Where each node stands.
#[derive(Clone, Debug, PartialEq)]
enum Stand {
    Fetching(u64, Option<u64>),
    Done,
    Failed(String),
}

/// Where node `n` stands in warming `ans`.
fn stand_of(n: &labsync_agent::proto::NodeStatus, ans: &WarmAnswer) -> Stand {
    let warming = n.warming.iter().find(|w| w.label == ans.label);
    let present = n.data.iter().find(|d| d.snapshot == ans.snapshot);
    match (warming, present) {
        (Some(w), _) if w.error.is_some() => Stand::Failed(w.error.clone().unwrap_or_default()),
        (Some(w), _) => Stand::Fetching(w.done_bytes, w.total_bytes),
        (None, Some(p)) if p.pinned && p.present_bytes == p.total_bytes => Stand::Done,
        _ => Stand::Fetching(0, None),
    }
}

/// Says where node `name` stands now, when it moved.
fn say_stand(printer: &Printer, name: &str, label: &str, stand: &Stand) {
    match stand {
        Stand::Done => printer.info(&format!("{name}: {label} cached and pinned")),
        Stand::Failed(e) => printer.info(&format!("{name}: FAILED: {e}")),
        Stand::Fetching(done, Some(total)) => printer.info(&format!(
            "{name}: {} of {} fetched",
            human_bytes(*done),
            human_bytes(*total)
        )),
        Stand::Fetching(..) => {}
    }
}

/// Sends the order, then follows it on every node.
pub async fn warm(s: &Settings, printer: &Printer, a: WarmArgs) -> Result<ExitCode> {
    // Exactly one of the two is needed (clap refuses both).
    if a.all != a.nodes.is_empty() {
        bail!("name the nodes (--nodes gpu3,gpu4) or ask for --all, one of the two");
    }
    let Some(addr) = a.labd.clone().or(s.labd.clone()) else {
        bail!(
            "labsync warm asks the cluster's coordinator: give its address with --labd \
             http://HOST:PORT (or LABRUN_LABD, or `labd` in the config file)"
        );
    };
    let token = std::env::var("LABRUN_TOKEN")
        .ok()
        .map(labsync_agent::Secret::from)
        .or(s.token.clone());
    let client = crate::local::client_of(&addr, token, s)?;
    let ask = WarmAsk {
        name: a.name.clone(),
        nodes: a.nodes.clone(),
        unpin: a.unpin,
    };
    let ans = client.warm_ask(&ask).await.map_err(explain_client)?;
    if a.unpin {
        printer.out(
            || format!("unpinned {} on {}", ans.label, ans.nodes.join(", ")),
            json!({"command": "warm", "unpinned": ans.label, "nodes": ans.nodes}),
        );
        return Ok(ExitCode::SUCCESS);
    }
    printer.info(&format!(
        "warming {} on {}",
        ans.label,
        ans.nodes.join(", ")
    ));
    let mut last: BTreeMap<NodeName, Stand> = BTreeMap::new();
    loop {
        let st = client.cluster_status().await.map_err(explain_client)?;
        let mut stands = BTreeMap::new();
        for name in &ans.nodes {
            let Some(n) = st.nodes.iter().find(|n| &n.name == name) else {
                continue;
            };
            let stand = stand_of(n, &ans);
            if last.get(name) != Some(&stand) {
                say_stand(printer, name, &ans.label, &stand);
            }
            stands.insert(name.clone(), stand);
        }
        last = stands;
        let finished = last.len() == ans.nodes.len()
            && last
                .values()
                .all(|s| matches!(s, Stand::Done | Stand::Failed(_)));
        if finished {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let failed: Vec<&NodeName> = last
        .iter()
        .filter(|(_, s)| matches!(s, Stand::Failed(_)))
        .map(|(n, _)| n)
        .collect();
    printer.out(
        || {
            if failed.is_empty() {
                format!(
                    "{} warmed and pinned on {}",
                    ans.label,
                    ans.nodes.join(", ")
                )
            } else {
                format!("{} could not be warmed on {:?}", ans.label, failed)
            }
        },
        json!({"command": "warm", "version": ans.label, "nodes": ans.nodes, "failed": failed}),
    );
    Ok(if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

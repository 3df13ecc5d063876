//! `labsync info`: what the store is and how this client writes to it.

use std::process::ExitCode;

use anyhow::Result;
use serde_json::json;

use super::StoreContext;

/// Prints the store's URL, format, chunker, hash, pack size, this client's
/// compression, and what its server does with conditional writes (with the
/// scheme versions are numbered by).
pub async fn info(ctx: &StoreContext) -> Result<ExitCode> {
    let repo = ctx.repo().await?;
    let c = repo.config();
    let cw = c.conditional_writes();
    // Stores made before labsync probed the server record nothing.
    let probed = c.conditional_writes.is_some();
    let how = if probed {
        format!("{cw} (probed, and recorded in the store's config)")
    } else {
        format!("{cw} (assumed: the store was made before labsync probed servers)")
    };
    let scheme = if repo.remote().is_server() {
        cw.scheme()
    } else {
        "an atomic create (a hard link in a local folder; memory for tests)"
    };
    let p = &c.params;
    ctx.printer.out(
        || {
            [
                format!("store:              {}", ctx.settings.store),
                format!("id:                 {}", c.id),
                format!("format:             {}", c.format),
                format!(
                    "chunker:            {} (min {} / avg {} / max {} bytes)",
                    c.chunker, p.min, p.avg, p.max
                ),
                format!("hash:               {}", c.hash),
                format!("pack size:          {} MiB", c.pack_size >> 20),
                format!(
                    "compression:        {} (this client's pushes)",
                    ctx.settings.compression
                ),
                if c.gc_grace_secs < c.gc_grace() {
                    format!(
                        "gc grace:           {} s asked, {} s taken (the floor)",
                        c.gc_grace_secs,
                        c.gc_grace()
                    )
                } else {
                    format!("gc grace:           {} s", c.gc_grace_secs)
                },
                format!("conditional writes: {how}"),
                format!("versions created by {scheme}"),
            ]
            .join("\n")
        },
        json!({
            "command": "info",
            "store": ctx.settings.store,
            "config": c,
            "compression": ctx.settings.compression.to_string(),
            "conditional_writes": cw,
            "conditional_writes_probed": probed,
            "scheme": scheme,
        }),
    );
    Ok(ExitCode::SUCCESS)
}

//! Fills a local store's `index/` with index objects, as years of pushes
//! leave them: `index-objects STORE_DIR N [CHUNKS]` writes N objects of one
//! pack each, CHUNKS chunks per pack (default 20). The packs do not exist:
//! loading the index does not read them, which is what is measured
//! (`bench/outputs-load.sh`).

use labsync_store::{IndexPack, PackEntry, PackId, Remote, Repo};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(dir), Some(n)) = (
        args.first(),
        args.get(1).and_then(|n| n.parse::<u32>().ok()),
    ) else {
        eprintln!("usage: index-objects STORE_DIR N [CHUNKS]");
        std::process::exit(2);
    };
    let chunks: u32 = args.get(2).and_then(|c| c.parse().ok()).unwrap_or(20);
    let rt = tokio::runtime::Runtime::new().expect("a runtime");
    rt.block_on(async {
        let remote = Remote::local(std::path::Path::new(dir)).expect("the store");
        let repo = Repo::open(remote, None).await.expect("the store opens");
        for i in 0..n {
            let entries: Vec<PackEntry> = (0..chunks)
                .map(|c| PackEntry {
                    id: labsync_store::ChunkId::of(format!("bench {i} {c}").as_bytes()),
                    offset: u64::from(c) * 1024,
                    stored_len: 1024,
                    raw_len: 1024,
                    flags: 0,
                })
                .collect();
            let pack = PackId::of(format!("bench pack {i}").as_bytes());
            let rec = IndexPack::new(pack, u64::from(chunks) * 1024 + 4096, &entries);
            repo.write_index(&[rec])
                .await
                .expect("an index object written");
        }
        repo.remote().sync().await.expect("synced");
    });
}

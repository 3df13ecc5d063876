//! The config reference (`docs/config.md`) cannot drift from the config
//! files labd and labsync accept: every key a file takes is documented, and
//! every documented key is taken.
//!
//! The keys a file takes are read off the structs it is parsed into, as
//! serde sees them (a struct tells its deserializer its field names), so a
//! key added to a struct without a line in the reference fails here, and so
//! does a line left behind for a key that was removed.

use std::collections::BTreeSet;
use std::fmt;

use serde::de::{self, Deserialize, Deserializer, Visitor};

use crate::labd_config::{ClusterFile, LabFile, LabdFile, NotifyFile, SlurmFile, TlsFile, WebFile};
use crate::settings::{self, FileConfig};

/// A deserializer that answers a struct's request with the struct's field
/// names, as an error.
struct Catch;

#[derive(Debug)]
struct Caught(Vec<&'static str>);

impl fmt::Display for Caught {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "fields {:?}", self.0)
    }
}

impl std::error::Error for Caught {}

impl de::Error for Caught {
    fn custom<T: fmt::Display>(_: T) -> Caught {
        Caught(Vec::new())
    }
}

impl<'de> Deserializer<'de> for Catch {
    type Error = Caught;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Caught> {
        Err(Caught(Vec::new()))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Caught> {
        Err(Caught(fields.to_vec()))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf option unit unit_struct newtype_struct seq tuple
        tuple_struct map enum identifier ignored_any
    }
}

/// The keys `T`'s file table takes.
fn keys<'de, T: Deserialize<'de>>() -> BTreeSet<String> {
    let fields = match T::deserialize(Catch) {
        Err(Caught(f)) => f,
        Ok(_) => panic!("not a struct"),
    };
    assert!(!fields.is_empty(), "no fields read off the struct");
    fields.into_iter().map(String::from).collect()
}

/// The tables one part (`## ` heading) of the reference documents: table
/// path (`""` for the top level, `lab.users`) → the keys of its rows.
fn documented(doc: &str, part: &str) -> Vec<(String, BTreeSet<String>)> {
    let start = doc
        .lines()
        .position(|l| l.trim() == format!("## {part}"))
        .unwrap_or_else(|| panic!("docs/config.md has no '## {part}'"));
    let mut tables: Vec<(String, BTreeSet<String>)> = Vec::new();
    for line in doc.lines().skip(start + 1) {
        if line.starts_with("## ") {
            break;
        }
        if let Some(h) = line.strip_prefix("### ") {
            let h = h.trim();
            let path = if h == "Top level" {
                String::new()
            } else {
                h.strip_prefix("`[")
                    .and_then(|h| h.strip_suffix("]`"))
                    .unwrap_or_else(|| panic!("heading {h:?}: write Top level or `[table]`"))
                    .to_string()
            };
            tables.push((path, BTreeSet::new()));
        } else if let Some(row) = line.strip_prefix("| `") {
            let key = row.split('`').next().unwrap_or_default();
            let (_, keys) = tables
                .last_mut()
                .unwrap_or_else(|| panic!("row {line:?} before any ### heading"));
            assert!(keys.insert(key.to_string()), "{key} documented twice");
        }
    }
    tables
}

/// The keys documented for the table at `path`: its rows, and its
/// sub-tables' headings.
fn documented_keys(tables: &[(String, BTreeSet<String>)], path: &str) -> BTreeSet<String> {
    let mut keys = tables
        .iter()
        .find(|(p, _)| p == path)
        .map(|(_, k)| k.clone())
        .unwrap_or_default();
    for (p, _) in tables {
        let child = match path {
            "" => Some(p.as_str()),
            _ => p.strip_prefix(path).and_then(|c| c.strip_prefix('.')),
        };
        if let Some(c) = child.filter(|c| !c.is_empty() && !c.contains('.')) {
            keys.insert(c.to_string());
        }
    }
    keys
}

fn check(
    tables: &[(String, BTreeSet<String>)],
    part: &str,
    path: &str,
    accepted: BTreeSet<String>,
) -> Vec<String> {
    let doc = documented_keys(tables, path);
    let table = if path.is_empty() {
        "the top level".to_string()
    } else {
        format!("[{path}]")
    };
    let mut wrong = Vec::new();
    for k in accepted.difference(&doc) {
        wrong.push(format!(
            "{part} {table}: `{k}` is accepted but not documented"
        ));
    }
    for k in doc.difference(&accepted) {
        wrong.push(format!(
            "{part} {table}: `{k}` is documented but not accepted"
        ));
    }
    wrong
}

fn reference() -> String {
    let p = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/config.md");
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{p}: {e}"))
}

#[test]
fn every_key_labd_takes_is_documented_and_every_documented_key_is_taken() {
    let doc = reference();
    let part = "`labd.toml`";
    let tables = documented(&doc, part);
    let mut wrong = Vec::new();
    wrong.extend(check(&tables, part, "", keys::<LabdFile>()));
    wrong.extend(check(&tables, part, "cluster", keys::<ClusterFile>()));
    wrong.extend(check(&tables, part, "lab", keys::<LabFile>()));
    wrong.extend(check(&tables, part, "tls", keys::<TlsFile>()));
    wrong.extend(check(&tables, part, "slurm", keys::<SlurmFile>()));
    wrong.extend(check(&tables, part, "web", keys::<WebFile>()));
    wrong.extend(check(&tables, part, "notify", keys::<NotifyFile>()));
    // Maps (user = token, user = tier, user = date, tier = limit) have no fixed keys.
    for map in ["tokens", "lab.users", "lab.grants", "lab.time_limits"] {
        let (_, rows) = tables
            .iter()
            .find(|(p, _)| p == map)
            .unwrap_or_else(|| panic!("docs/config.md documents no [{map}]"));
        assert!(
            rows.is_empty(),
            "[{map}] is a map: it has no fixed keys to list"
        );
    }
    let known = [
        "",
        "cluster",
        "lab",
        "tls",
        "slurm",
        "web",
        "notify",
        "tokens",
        "lab.users",
        "lab.grants",
        "lab.time_limits",
    ];
    for (p, _) in &tables {
        assert!(
            known.contains(&p.as_str()),
            "[{p}] is documented but labd has no such table"
        );
    }
    assert!(
        wrong.is_empty(),
        "docs/config.md has drifted:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn every_key_the_users_config_takes_is_documented_and_every_documented_key_is_taken() {
    let doc = reference();
    let part = "`~/.config/labsync/config.toml` (labsync and labrun)";
    let tables = documented(&doc, part);
    let mut wrong = Vec::new();
    wrong.extend(check(&tables, part, "", keys::<FileConfig>()));
    wrong.extend(check(&tables, part, "slurm", keys::<settings::SlurmFile>()));
    for (p, _) in &tables {
        assert!(
            ["", "slurm"].contains(&p.as_str()),
            "[{p}] is documented but the config has no such table"
        );
    }
    assert!(
        wrong.is_empty(),
        "docs/config.md has drifted:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_reader_of_the_reference_sees_rows_headings_and_maps() {
    let doc = "## `x.toml`\n\n### Top level\n\n| key | default |\n|---|---|\n| `a` | 1 |\n\
               | `b` | 2 |\n\n### `[t]`\n\n| `c` | 3 |\n\n### `[t.m]`\n\nA map.\n\n## other\n\
               | `z` | 9 |\n";
    let tables = documented(doc, "`x.toml`");
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(documented_keys(&tables, ""), names(&["a", "b", "t"]));
    assert_eq!(documented_keys(&tables, "t"), names(&["c", "m"]));
    assert_eq!(documented_keys(&tables, "t.m"), names(&[]));
    let wrong = check(&tables, "x", "t", names(&["c", "d"]));
    assert_eq!(
        wrong,
        vec![
            "x [t]: `d` is accepted but not documented".to_string(),
            "x [t]: `m` is documented but not accepted".to_string()
        ]
    );
    assert!(keys::<TlsFile>().contains("ca"));
}

/// The config the packages install (`dist/labd.toml`) parses as labd reads
/// it, and every key it names, commented out or not, is one labd takes in
/// that table: an admin who uncomments a line gets a working key.
#[test]
fn the_packaged_config_parses_and_names_only_keys_labd_takes() {
    let p = concat!(env!("CARGO_MANIFEST_DIR"), "/../../dist/labd.toml");
    let text = std::fs::read_to_string(p).unwrap();
    let _: LabdFile = toml::from_str(&text).unwrap_or_else(|e| panic!("{p}: {e}"));
    let tables = [
        ("", keys::<LabdFile>()),
        ("cluster", keys::<ClusterFile>()),
        ("tls", keys::<TlsFile>()),
        ("slurm", keys::<SlurmFile>()),
        ("lab", keys::<LabFile>()),
        ("web", keys::<WebFile>()),
        ("notify", keys::<NotifyFile>()),
    ];
    let mut table = "";
    let mut named = 0;
    for line in text.lines() {
        let l = line.trim_start_matches('#').trim();
        if let Some(t) = l.strip_prefix('[').and_then(|t| t.strip_suffix(']')) {
            table = tables
                .iter()
                .find(|(n, _)| *n == t)
                .unwrap_or_else(|| panic!("{p}: [{t}] is no table labd takes"))
                .0;
            continue;
        }
        // `key = value` lines, commented or not; prose has no ` = ` after
        // a bare word.
        let Some((k, _)) = l.split_once(" = ") else {
            continue;
        };
        if k.is_empty() || !k.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') {
            continue;
        }
        let (_, keys) = tables.iter().find(|(n, _)| *n == table).unwrap();
        assert!(keys.contains(k), "{p}: `{k}` is no key of [{table}]");
        named += 1;
    }
    assert!(named >= 10, "{p} names {named} keys");
}

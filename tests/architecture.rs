//! The shape of `src/`, checked as text (no build needed): the file-level import graph has no
//! circle, every arrow between parts (top-level modules) is one docs/architecture.md's table
//! "Which part may use which" allows, nothing below `app.rs` imports the assembly, no source
//! file is over 700 lines and no function over 100, unless a one-line `// long:` comment right
//! above it says why.
//!
//! The graph: an arrow from file A to file B when A names a path that resolves into B's
//! module (`use crate::…`, `super::…`, `self::…`, an inline `crate::a::b::f()`, or a child
//! module named by its parent as `child::f()`). A module's own `mod x;` is not an arrow.
//! Test modules (`#[cfg(test)]` to the end of the file) are left out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use regex::Regex;

/// Module path (`["engine", "journal"]`) → file, for the library crate.
fn modules() -> BTreeMap<Vec<String>, PathBuf> {
    let mut out = BTreeMap::new();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut stack = vec![root.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let rel = path.strip_prefix(&root).unwrap().to_path_buf();
            if path.is_dir() {
                if rel != Path::new("bin") {
                    stack.push(path);
                }
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") || rel == Path::new("main.rs") {
                continue;
            }
            let mut segments: Vec<String> = rel
                .with_extension("")
                .iter()
                .map(|s| s.to_string_lossy().into_owned())
                .collect();
            if segments.last().is_some_and(|s| s == "mod" || s == "lib") {
                segments.pop();
            }
            out.insert(segments, rel);
        }
    }
    out
}

/// The file's code without comments, string contents and its test module.
fn code_of(text: &str) -> String {
    let mut code = String::new();
    for line in text.lines() {
        if line.starts_with("#[cfg(test)]") {
            break;
        }
        let trimmed = line.trim_start();
        if trimmed.starts_with("//") {
            continue;
        }
        code.push_str(line);
        code.push('\n');
    }
    // String literals hold `a::b` text that is not a path.
    Regex::new(r#""([^"\\]|\\.)*""#)
        .unwrap()
        .replace_all(&code, "\"\"")
        .into_owned()
}

/// `a::{b, c::{d, e}}` → `a::b`, `a::c::d`, `a::c::e`.
fn expand(tree: &str) -> Vec<String> {
    let tree: String = tree.chars().filter(|c| !c.is_whitespace()).collect();
    let Some(open) = tree.find('{') else {
        return vec![tree.split(" as ").next().unwrap_or(&tree).to_string()];
    };
    let prefix = &tree[..open];
    let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .filter(|p| !p.is_empty())
        .flat_map(|p| expand(&format!("{prefix}{p}")))
        .collect()
}

/// The module a path points into: the longest prefix that is a module of the crate.
fn resolve(
    path: &[String],
    here: &[String],
    mods: &BTreeMap<Vec<String>, PathBuf>,
) -> Option<Vec<String>> {
    let mut abs: Vec<String> = Vec::new();
    let mut rest = path;
    match path.first().map(String::as_str) {
        Some("crate") | Some("$crate") => rest = &path[1..],
        Some("self") => {
            abs = here.to_vec();
            rest = &path[1..];
        }
        Some("super") => {
            abs = here.to_vec();
            while rest.first().is_some_and(|s| s == "super") {
                abs.pop();
                rest = &rest[1..];
            }
        }
        _ => return None,
    }
    abs.extend(rest.iter().filter(|s| *s != "self").cloned());
    (0..=abs.len())
        .rev()
        .map(|n| abs[..n].to_vec())
        .find(|p| mods.contains_key(p))
}

fn graph() -> (
    BTreeMap<Vec<String>, PathBuf>,
    BTreeMap<PathBuf, BTreeSet<PathBuf>>,
) {
    let mods = modules();
    let use_re = Regex::new(r"(?s)\buse\s+((?:crate|super|self)::[^;]*);").unwrap();
    let inline_re = Regex::new(r"(\$?crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)").unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    for (here, file) in &mods {
        // The crate root declares every module; it is above them all.
        if here.is_empty() {
            continue;
        }
        let code = code_of(&std::fs::read_to_string(root.join(file)).unwrap());
        let mut paths: Vec<Vec<String>> = Vec::new();
        for cap in use_re.captures_iter(&code) {
            for p in expand(&cap[1]) {
                paths.push(p.split("::").map(str::to_string).collect());
            }
        }
        let without_uses = use_re.replace_all(&code, "");
        for cap in inline_re.captures_iter(&without_uses) {
            let mut p = vec![cap[1].to_string()];
            p.extend(
                cap[2]
                    .split("::")
                    .filter(|s| !s.is_empty())
                    .map(str::to_string),
            );
            paths.push(p);
        }
        // A parent naming its child module (`single_turn::run(…)`).
        for (child, _) in mods.range(here.clone()..) {
            if child.len() == here.len() + 1 && child.starts_with(here) {
                let name = child.last().unwrap();
                let re = Regex::new(&format!(r"(?:^|[^:\w]){name}::")).unwrap();
                if re.is_match(&without_uses) {
                    let mut p = vec!["self".to_string()];
                    p.push(name.clone());
                    paths.push(p);
                }
            }
        }
        let targets = edges.entry(file.clone()).or_default();
        for p in paths {
            if let Some(target) = resolve(&p, here, &mods) {
                let target = &mods[&target];
                if target != file && !target.ends_with("lib.rs") {
                    targets.insert(target.clone());
                }
            }
        }
    }
    (mods, edges)
}

/// Strongly connected components with more than one file (Tarjan).
fn circles(edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    struct State<'a> {
        edges: &'a BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        index: BTreeMap<&'a PathBuf, usize>,
        low: BTreeMap<&'a PathBuf, usize>,
        stack: Vec<&'a PathBuf>,
        on_stack: BTreeSet<&'a PathBuf>,
        next: usize,
        out: Vec<Vec<PathBuf>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a PathBuf) {
        s.index.insert(v, s.next);
        s.low.insert(v, s.next);
        s.next += 1;
        s.stack.push(v);
        s.on_stack.insert(v);
        let targets = s.edges.get(v).into_iter().flatten();
        for w in targets {
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w.clone());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.out.push(component);
            }
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

#[test]
fn the_import_graph_has_no_circle() {
    let (_, edges) = graph();
    let found = circles(&edges);
    let described: Vec<String> = found
        .iter()
        .map(|c| {
            let members: BTreeSet<&PathBuf> = c.iter().collect();
            let arrows: Vec<String> = c
                .iter()
                .flat_map(|from| {
                    edges[from]
                        .iter()
                        .filter(|to| members.contains(to))
                        .map(move |to| format!("{} -> {}", from.display(), to.display()))
                })
                .collect();
            arrows.join(", ")
        })
        .collect();
    assert!(
        found.is_empty(),
        "import circles in src/:\n{}",
        described.join("\n")
    );
}

#[test]
fn only_the_assembly_and_the_binaries_know_the_app() {
    let (_, edges) = graph();
    let offenders: Vec<String> = edges
        .iter()
        .filter(|(_, to)| to.contains(Path::new("app.rs")))
        .map(|(from, _)| from.display().to_string())
        .collect();
    assert!(
        offenders.is_empty(),
        "files below app.rs that import it: {offenders:?}"
    );
}

/// Files and functions within their size, or marked with a reason.
#[test]
fn no_file_over_700_lines_and_no_function_over_100() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![root.join("main.rs")];
    files.extend(modules().values().map(|f| root.join(f)));
    let mut bins = vec![root.join("bin")];
    while let Some(dir) = bins.pop() {
        for entry in std::fs::read_dir(dir).into_iter().flatten() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                bins.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    let fn_re = Regex::new(r"^\s*(pub(\([a-z]+\))?\s+)?(async\s+)?fn\s+(\w+)").unwrap();
    let mut problems = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        // The test module does not count toward the file's size.
        let code_lines = lines
            .iter()
            .position(|l| l.starts_with("#[cfg(test)]"))
            .unwrap_or(lines.len());
        let name = file.strip_prefix(&root).unwrap().display().to_string();
        if code_lines > 700 && !text.contains("// long file:") {
            problems.push(format!("{name}: {code_lines} lines"));
        }
        for (i, line) in lines.iter().enumerate().take(code_lines) {
            let Some(cap) = fn_re.captures(line) else {
                continue;
            };
            let indent = line.len() - line.trim_start().len();
            let close = format!("{}}}", " ".repeat(indent));
            let Some(len) = lines[i..].iter().position(|l| *l == close) else {
                continue;
            };
            let marked = lines[..i]
                .iter()
                .rev()
                .take_while(|l| {
                    l.trim_start().starts_with("//") || l.trim_start().starts_with("#[")
                })
                .any(|l| l.contains("// long:"));
            if len > 100 && !marked {
                problems.push(format!("{name}:{} fn {} is {len} lines", i + 1, &cap[4]));
            }
        }
    }
    assert!(problems.is_empty(), "too long:\n{}", problems.join("\n"));
}

/// The checker itself: a planted circle is found, a chain is not, and grouped imports expand.
#[test]
fn the_checker_finds_a_planted_circle() {
    let p = |s: &str| PathBuf::from(s);
    let mut edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    edges.insert(p("a.rs"), [p("b.rs")].into());
    edges.insert(p("b.rs"), [p("c.rs")].into());
    edges.insert(p("c.rs"), BTreeSet::new());
    assert!(circles(&edges).is_empty(), "a chain is not a circle");
    edges.insert(p("c.rs"), [p("a.rs")].into());
    assert_eq!(circles(&edges), vec![vec![p("a.rs"), p("b.rs"), p("c.rs")]]);
    assert_eq!(
        expand("crate::store::{Store, tasks::{Fence, TaskRow}}"),
        vec![
            "crate::store::Store",
            "crate::store::tasks::Fence",
            "crate::store::tasks::TaskRow"
        ]
    );
}

/// The layers: SQL only in `store/`, the web framework only in `http/` (and in the bench's
/// own mock servers), so domain code is testable without either.
#[test]
fn sql_stays_in_the_store_and_axum_in_http() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut problems = Vec::new();
    for (_, file) in modules() {
        let code = code_of(&std::fs::read_to_string(root.join(&file)).unwrap());
        let name = file.display().to_string();
        let in_store = name.starts_with("store/");
        let in_http = name.starts_with("http/") || name == "app.rs";
        if !in_store && (code.contains("sqlx::query") || code.contains("sqlx::Pg")) {
            problems.push(format!("{name} runs SQL"));
        }
        if !in_http && code.contains("axum") {
            problems.push(format!("{name} uses axum"));
        }
    }
    assert!(problems.is_empty(), "{problems:?}");
}

/// The part of a file: its top-level module (`engine/workflow/runner.rs` → `engine`).
fn part_of(file: &Path) -> String {
    let first = file.iter().next().unwrap().to_string_lossy().into_owned();
    first.trim_end_matches(".rs").to_string()
}

/// docs/architecture.md's table "Which part may use which": part → the parts it may use.
fn allowed_parts() -> BTreeMap<String, BTreeSet<String>> {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/architecture.md"))
            .unwrap();
    let table = doc
        .split("<!-- parts: begin -->")
        .nth(1)
        .and_then(|rest| rest.split("<!-- parts: end -->").next())
        .expect("docs/architecture.md has the parts table between its markers");
    let names = Regex::new(r"`(\w+)`").unwrap();
    let mut allowed = BTreeMap::new();
    for row in table.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = row.split('|').collect();
        let uses: BTreeSet<String> = names
            .captures_iter(cells[2])
            .map(|c| c[1].to_string())
            .collect();
        for part in names.captures_iter(cells[1]) {
            allowed.insert(part[1].to_string(), uses.clone());
        }
    }
    allowed
}

/// Arrows between parts that the table does not allow, as `from -> to (part -> part)`.
fn back_arrows(
    edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>,
    allowed: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<String> {
    let mut found = Vec::new();
    for (from, targets) in edges {
        let part = part_of(from);
        if part == "app" {
            continue;
        }
        for to in targets {
            let used = part_of(to);
            let ok = used == part || allowed.get(&part).is_some_and(|uses| uses.contains(&used));
            if !ok {
                found.push(format!(
                    "{} -> {} ({part} -> {used})",
                    from.display(),
                    to.display()
                ));
            }
        }
    }
    found
}

#[test]
fn every_part_uses_only_the_parts_docs_architecture_allows() {
    let (mods, edges) = graph();
    let allowed = allowed_parts();
    // Every part of src/ has its row, and the table names no part that is not there.
    let parts: BTreeSet<String> = mods
        .values()
        .map(|f| part_of(f))
        .filter(|p| p != "lib" && p != "app")
        .collect();
    let listed: BTreeSet<String> = allowed.keys().cloned().collect();
    assert_eq!(
        parts, listed,
        "the parts of src/ and the table's rows differ"
    );
    let found = back_arrows(&edges, &allowed);
    assert!(
        found.is_empty(),
        "arrows docs/architecture.md does not allow (add them to its table, or remove them):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_checker_finds_a_planted_back_arrow() {
    let (_, mut edges) = graph();
    let allowed = allowed_parts();
    // The engine using agents.rs (the definition's old home) is the arrow issue 34 removed.
    edges
        .entry(PathBuf::from("engine/task.rs"))
        .or_default()
        .insert(PathBuf::from("agents.rs"));
    let found = back_arrows(&edges, &allowed);
    assert_eq!(
        found,
        vec!["engine/task.rs -> agents.rs (engine -> agents)".to_string()]
    );
}

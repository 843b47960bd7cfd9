#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The read-only tools: read, list, search, and the cap on what the model reads.

mod support;

use std::fs;

use keel_tools::{OBSERVATION_LIMIT, ToolError};
use support::{Fixture, assert_invalid, observation};

fn numbered(lines: usize) -> String {
    (1..=lines).map(|i| format!("line {i}\n")).collect()
}

// ---- read ----

#[test]
fn read_shows_numbered_lines() {
    let fx = Fixture::new();
    fx.file("poem.txt", "one\ntwo\r\nthree");
    let output = fx.ws.read("poem.txt", None, None).unwrap();
    assert_eq!(output.observation, "   1| one\n   2| two\n   3| three\n");
    assert_eq!(output.full, output.observation.as_bytes());
    assert!(output.changed.is_empty());
}

#[test]
fn read_with_offset_and_limit_shows_that_range_and_where_to_continue() {
    let fx = Fixture::new();
    fx.file("many.txt", &numbered(20));
    assert_eq!(
        observation(fx.ws.read("many.txt", Some(9), Some(3))),
        "[`many.txt`: lines 9-11 of 20]\n   9| line 9\n  10| line 10\n  11| line 11\n\
         [9 more lines; continue with offset=12]\n"
    );
    assert_eq!(
        observation(fx.ws.read("many.txt", Some(19), Some(100))),
        "[`many.txt`: lines 19-20 of 20]\n  19| line 19\n  20| line 20\n"
    );
    fx.file("wide.txt", &numbered(12_345));
    let wide = observation(fx.ws.read("wide.txt", Some(12_344), None));
    assert!(
        wide.contains("\n12344| line 12344\n12345| line 12345\n"),
        "{wide}"
    );
}

#[test]
fn read_refuses_offsets_outside_the_file() {
    let fx = Fixture::new();
    fx.file("three.txt", "a\nb\nc\n");
    let message = assert_invalid(fx.ws.read("three.txt", Some(4), None));
    assert_eq!(
        message,
        "offset 4 is beyond the end of `three.txt`, which has 3 lines"
    );
    assert_invalid(fx.ws.read("three.txt", Some(0), None));
    assert_invalid(fx.ws.read("three.txt", None, Some(0)));
    fx.file("empty.txt", "");
    assert_eq!(
        observation(fx.ws.read("empty.txt", None, None)),
        "`empty.txt` is empty (0 lines)"
    );
}

#[test]
fn read_of_a_binary_file_names_it_and_its_size() {
    let fx = Fixture::new();
    let mut bytes = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR".to_vec();
    bytes.extend(std::iter::repeat_n(7u8, 1000));
    fs::write(fx.root().join("logo.png"), &bytes).unwrap();
    let output = fx.ws.read("logo.png", None, None).unwrap();
    assert_eq!(
        output.observation,
        format!(
            "`logo.png` is a binary file ({} bytes); it is not shown as text",
            bytes.len()
        )
    );
}

#[test]
fn read_of_a_directory_says_to_list_it() {
    let fx = Fixture::new();
    let message = assert_invalid(fx.ws.read("src", None, None));
    assert!(message.contains("use list"), "{message}");
}

#[test]
fn read_observation_is_capped_with_a_marker_saying_where_to_continue() {
    let fx = Fixture::new();
    fx.file("big.txt", &numbered(3000));
    let output = fx.ws.read("big.txt", None, Some(3000)).unwrap();
    let full = String::from_utf8(output.full).unwrap();
    assert!(full.ends_with("3000| line 3000\n"));
    let observation = output.observation;
    assert!(observation.len() <= OBSERVATION_LIMIT);
    assert!(full.starts_with(observation.rsplit_once('\n').unwrap().0));
    let last_shown = observation
        .lines()
        .rev()
        .find_map(|line| {
            line.split_once("| line ")
                .map(|(n, _)| n.trim().parse::<u64>().unwrap())
        })
        .unwrap();
    let marker = observation.lines().last().unwrap();
    assert!(
        marker.starts_with(&format!("[… {} more lines (", 3000 - last_shown))
            && marker.ends_with(&format!(
                "bytes) not shown; narrow the request: continue with offset={}]",
                last_shown + 1
            )),
        "{marker}"
    );
}

// ---- list ----

fn tree(fx: &Fixture) {
    fx.file(".gitignore", "target/\n*.log\n");
    fx.file("README.md", "# hi\n");
    fx.file("debug.log", "noise\n");
    fx.file("target/debug/app", "bin\n");
    fx.file("src/a/b/c/deep.rs", "deep\n");
    fx.file("src/a/mod.rs", "mod b;\n");
    fx.file("src/nested/.git/HEAD", "ref\n");
    fx.file("src/nested/code.rs", "code\n");
    fx.file("vendor/cache/blob", "x\n");
    fx.symlink("src/link", "../README.md");
}

#[test]
fn list_respects_gitignore_and_never_shows_denied_dirs() {
    let fx = Fixture::with_denied(&["vendor/cache"]);
    tree(&fx);
    let output = fx.ws.list("", Some(10)).unwrap();
    assert_eq!(
        output.observation,
        "\
.gitignore
README.md
b.txt
src/
src/a/
src/a/b/
src/a/b/c/
src/a/b/c/deep.rs
src/a/mod.rs
src/lib.rs
src/link -> ../README.md
src/nested/
src/nested/code.rs
vendor/
"
    );
}

#[test]
fn list_depth_limits_the_levels_shown() {
    let fx = Fixture::new();
    tree(&fx);
    assert_eq!(
        observation(fx.ws.list(".", Some(1))),
        ".gitignore\nREADME.md\nb.txt\nsrc/\nvendor/\n"
    );
    // The default is two levels.
    assert_eq!(
        observation(fx.ws.list("src", None)),
        "src/a/\nsrc/a/b/\nsrc/a/mod.rs\nsrc/lib.rs\nsrc/link -> ../README.md\nsrc/nested/\n\
         src/nested/code.rs\n"
    );
    assert_eq!(observation(fx.ws.list("src/lib.rs", None)), "src/lib.rs");
    assert_eq!(
        observation(fx.ws.list("src/a/b/c", None)),
        "src/a/b/c/deep.rs\n"
    );
    assert_invalid(fx.ws.list("", Some(0)));
}

#[test]
fn list_of_a_missing_dir_is_not_found() {
    let fx = Fixture::new();
    let error = fx.ws.list("nope", None).unwrap_err();
    assert!(matches!(error, ToolError::NotFound { .. }), "{error:?}");
}

#[test]
fn list_observation_is_capped_with_a_marker() {
    let fx = Fixture::new();
    for i in 0..1500 {
        fx.file(&format!("many/file-{i:04}.txt"), "");
    }
    let output = fx.ws.list("many", None).unwrap();
    assert_eq!(
        String::from_utf8(output.full).unwrap().lines().count(),
        1500
    );
    assert!(output.observation.len() <= OBSERVATION_LIMIT);
    let marker = output.observation.lines().last().unwrap();
    assert!(marker.starts_with("[… "), "{marker}");
    assert!(
        marker.ends_with("not shown; narrow the request: list a subdirectory, or a smaller depth]"),
        "{marker}"
    );
}

// ---- search ----

#[test]
fn search_finds_matches_as_path_line_text() {
    let fx = Fixture::new();
    fx.file("src/a.rs", "fn alpha() {}\nfn beta() {}\n// alpha again\n");
    fx.file("src/b.rs", "struct Alpha;\n");
    assert_eq!(
        observation(fx.ws.search("alpha", None, None)),
        "src/a.rs:1: fn alpha() {}\nsrc/a.rs:3: // alpha again\n"
    );
    assert_eq!(
        observation(fx.ws.search("(?i)^struct alpha", Some("src"), None)),
        "src/b.rs:1: struct Alpha;\n"
    );
    assert_eq!(
        observation(fx.ws.search("beta", Some("src/a.rs"), None)),
        "src/a.rs:2: fn beta() {}\n"
    );
    assert_eq!(
        observation(fx.ws.search("gamma", Some("src"), None)),
        "no matches for `gamma` in `src`\n"
    );
}

#[test]
fn search_skips_ignored_binary_denied_and_symlinked_files() {
    let fx = Fixture::with_denied(&["vendor/cache"]);
    tree(&fx);
    fx.file("src/found.rs", "needle\n");
    fx.file("debug.log", "needle\n");
    fx.file("target/out.rs", "needle\n");
    fx.file(".keel/notes", "needle\n");
    fx.file(".git/COMMIT_EDITMSG", "needle\n");
    fx.file("src/nested/.git/info", "needle\n");
    fx.file("vendor/cache/needle.txt", "needle\n");
    fs::write(fx.root().join("blob.bin"), b"needle\0\x01\x02needle\n").unwrap();
    fs::write(fx.outside().join("far.txt"), "needle\n").unwrap();
    fx.symlink("far", fx.outside());
    fx.symlink("src/inner-link.rs", "found.rs");
    assert_eq!(
        observation(fx.ws.search("needle", None, None)),
        "src/found.rs:1: needle\n[1 file skipped as binary]\n"
    );
}

#[test]
fn search_with_an_invalid_regex_is_invalid() {
    let fx = Fixture::new();
    let message = assert_invalid(fx.ws.search("fn (", None, None));
    assert!(
        message.contains("`fn (` is not a valid regular expression"),
        "{message}"
    );
    assert_invalid(fx.ws.search("x", None, Some(0)));
}

#[test]
fn search_stops_at_max_results_and_says_so() {
    let fx = Fixture::new();
    fx.file("a.txt", "hit\nhit\nhit\n");
    fx.file("b.txt", "hit\nhit\n");
    assert_eq!(
        observation(fx.ws.search("hit", None, Some(4))),
        "a.txt:1: hit\na.txt:2: hit\na.txt:3: hit\nb.txt:1: hit\n\
         [stopped after 4 results in 2 files; there are more: narrow the pattern or the path, \
         or raise max_results]\n"
    );
    assert_eq!(
        observation(fx.ws.search("hit", None, Some(5)))
            .lines()
            .count(),
        5,
        "exactly max_results matches is not reported as cut"
    );
}

#[test]
fn search_observation_is_capped_with_a_marker() {
    let fx = Fixture::new();
    fx.file("hay.txt", &"needle in a haystack of text\n".repeat(2000));
    let output = fx.ws.search("needle", None, Some(5000)).unwrap();
    assert_eq!(
        String::from_utf8(output.full).unwrap().lines().count(),
        2000
    );
    assert!(output.observation.len() <= OBSERVATION_LIMIT);
    let marker = output.observation.lines().last().unwrap();
    assert!(
        marker.starts_with("[… ")
            && marker.ends_with("not shown; narrow the request: narrow the pattern or the path]"),
        "{marker}"
    );
}

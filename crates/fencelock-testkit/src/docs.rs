//! Checks of docs against code.

/// The option names of the options table in a backend's source: every
/// backticked `name=…` in the first column of a doc-comment table row
/// (`/// | \`ttl=\` | 30 s | … |`), sorted. A backend's tests compare them
/// with what its URL parser asks for (`BackendUrl::asked`).
///
/// # Examples
///
/// ```
/// let src = "/// | option | default |\n/// |---|---|\n/// | `ttl=` | 30 s |\n/// | `mode=lease\\|advisory`, `pool=` | lease |\n";
/// assert_eq!(fencelock_testkit::documented_options(src), ["mode", "pool", "ttl"]);
/// ```
pub fn documented_options(source: &str) -> Vec<String> {
    let mut names: Vec<String> = source
        .lines()
        .map(str::trim_start)
        .filter_map(|l| l.strip_prefix("/// |").or_else(|| l.strip_prefix("//! |")))
        .filter_map(|row| row.split(" | ").next())
        .flat_map(|cell| {
            cell.split('`')
                .skip(1)
                .step_by(2)
                .filter_map(|code| code.split_once('=').map(|(n, _)| n.trim().to_string()))
                .collect::<Vec<_>>()
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Asserts that the options table in `source` names exactly the options
/// `asked` (what a backend's URL parser asked for, `BackendUrl::asked`).
///
/// # Panics
///
/// If they differ, naming what each side lacks.
pub fn assert_options_documented(source: &str, asked: &[String]) {
    let documented = documented_options(source);
    let undocumented: Vec<&String> = asked.iter().filter(|a| !documented.contains(a)).collect();
    let unparsed: Vec<&String> = documented.iter().filter(|d| !asked.contains(d)).collect();
    assert!(
        undocumented.is_empty() && unparsed.is_empty(),
        "options the parser takes but the docs' table lacks: {undocumented:?}; \
         options in the table the parser does not take: {unparsed:?}"
    );
}

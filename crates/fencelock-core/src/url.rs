//! [`BackendUrl`]: the one parser of backend URLs, for backend authors.

use std::str::FromStr;
use std::time::Duration;

use crate::error::{Error, Result, redact_url};

/// A backend URL taken apart: `scheme://[user[:password]@]hosts[/path][?options]`.
///
/// Every backend parses its URL with it, so all of them agree on the form:
/// the login and option values are percent-decoded (`p%40ss` is `p@ss`), a
/// duration is written as humantime (`5s`, `250ms`), a bad value is named
/// with what was expected, an unknown option is named with the known ones,
/// and no message shows a password.
///
/// A backend takes the options it knows one by one, then calls
/// [`BackendUrl::finish`] (or keeps the rest for its client library with
/// [`BackendUrl::rest`]). The names it asked for are the options it knows:
/// unknown-option errors list them, and a backend's tests check its docs'
/// table of options against them.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use fencelock_core::backend::BackendUrl;
///
/// let mut url = BackendUrl::parse("etcd", "etcd://app:p%40ss@h1:2379,h2?ttl=5s&pool=4", &["etcd"])?;
/// assert_eq!(url.password(), Some("p@ss"));
/// assert_eq!(url.hosts().collect::<Vec<_>>(), ["h1:2379", "h2"]);
/// assert_eq!(url.take_duration("ttl")?, Some(Duration::from_secs(5)));
/// assert_eq!(url.take_parsed::<u32>("pool", "a number")?, Some(4));
/// url.finish()?;
///
/// let mut bad = BackendUrl::parse("etcd", "etcd://h?colour=red", &["etcd"])?;
/// bad.take_duration("ttl")?;
/// let err = bad.finish().unwrap_err().to_string();
/// assert!(err.contains("colour") && err.contains("known: ttl"));
/// # Ok::<(), fencelock_core::Error>(())
/// ```
#[derive(Clone)]
pub struct BackendUrl {
    backend: &'static str,
    redacted: String,
    scheme: String,
    base: String,
    user: Option<String>,
    password: Option<String>,
    hosts: String,
    path: String,
    options: Vec<UrlOption>,
    /// The names the backend asked for: the options it knows.
    asked: Vec<String>,
}

#[derive(Clone)]
struct UrlOption {
    raw: String,
    name: String,
    value: String,
}

impl std::fmt::Debug for BackendUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("BackendUrl").field(&self.redacted).finish()
    }
}

impl BackendUrl {
    /// Takes `url` apart for the backend called `backend`, which accepts the
    /// schemes `schemes` (compared without case).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] if the URL has another scheme, or a login or
    /// option that is not valid percent-encoded UTF-8.
    pub fn parse(backend: &'static str, url: &str, schemes: &[&str]) -> Result<BackendUrl> {
        let redacted = redact_url(url);
        let Some((scheme, rest)) = url
            .split_once("://")
            .filter(|(s, _)| schemes.iter().any(|k| k.eq_ignore_ascii_case(s)))
        else {
            let forms: Vec<String> = schemes.iter().map(|s| format!("{s}://")).collect();
            return Err(Error::config(format!(
                "{redacted:?} is not a URL of the {backend} backend; write {}",
                forms.join(" or ")
            )));
        };
        let (before_query, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (authority, path) = match before_query.find('/') {
            Some(i) => before_query.split_at(i),
            None => (before_query, ""),
        };
        let (login, hosts) = match authority.rfind('@') {
            Some(at) => (Some(&authority[..at]), &authority[at + 1..]),
            None => (None, authority),
        };
        let decode = |what: &str, text: &str| {
            percent_decode(text).ok_or_else(|| {
                Error::config(format!(
                    "{backend} URL {redacted:?}: bad escape in {what}; write a % sign as %25"
                ))
            })
        };
        let (user, password) = match login {
            Some(l) => {
                let (u, p) = match l.split_once(':') {
                    Some((u, p)) => (u, Some(p)),
                    None => (l, None),
                };
                (
                    Some(decode("the user", u)?),
                    p.map(|p| decode("the password", p)).transpose()?,
                )
            }
            None => (None, None),
        };
        let mut options = Vec::new();
        for raw in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = raw.split_once('=').unwrap_or((raw, ""));
            let name = decode("an option name", name)?;
            let value = decode(&format!("option {name}"), value)?;
            options.push(UrlOption {
                raw: raw.to_string(),
                name,
                value,
            });
        }
        Ok(BackendUrl {
            backend,
            redacted,
            scheme: scheme.to_ascii_lowercase(),
            base: format!("{scheme}://{before_query}"),
            user,
            password,
            hosts: hosts.to_string(),
            path: path.to_string(),
            options,
            asked: Vec::new(),
        })
    }

    /// The scheme, in lower case.
    pub fn scheme(&self) -> &str {
        &self.scheme
    }

    /// The URL without its options, as written (for a client library that
    /// takes the login and path in the same form).
    pub fn base(&self) -> &str {
        &self.base
    }

    /// The URL with any password replaced by `***`, for messages.
    pub fn redacted(&self) -> &str {
        &self.redacted
    }

    /// The user of the login, decoded.
    pub fn user(&self) -> Option<&str> {
        self.user.as_deref()
    }

    /// The password of the login, decoded.
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }

    /// The hosts between the login and the path, as written (`h1:p1,h2`).
    pub fn hosts_text(&self) -> &str {
        &self.hosts
    }

    /// The hosts, split at commas, blanks left out.
    pub fn hosts(&self) -> impl Iterator<Item = &str> {
        self.hosts
            .split(',')
            .map(str::trim)
            .filter(|h| !h.is_empty())
    }

    /// The path after the hosts, with its leading `/` (empty if none).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Takes option `name` out (the last value if it is given twice). Every
    /// name asked for counts as an option the backend knows
    /// ([`BackendUrl::asked`]).
    pub fn take(&mut self, name: &str) -> Option<String> {
        if !self.asked.iter().any(|a| a == name) {
            self.asked.push(name.to_string());
        }
        let mut value = None;
        self.options.retain(|o| {
            let hit = o.name == name;
            if hit {
                value = Some(o.value.clone());
            }
            !hit
        });
        value
    }

    /// Takes option `name` out as a duration (`5s`, `250ms`, `1m 30s`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the option if its value is not a duration.
    pub fn take_duration(&mut self, name: &str) -> Result<Option<Duration>> {
        self.take(name)
            .map(|v| {
                humantime::parse_duration(&v)
                    .map_err(|e| self.bad_value(name, &v, &format!("{e}; write e.g. {name}=5s")))
            })
            .transpose()
    }

    /// Takes option `name` out, parsed as a `T`; `expected` says what a
    /// valid value is ("a number of replicas").
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the option and `expected` if its value
    /// does not parse.
    pub fn take_parsed<T: FromStr>(&mut self, name: &str, expected: &str) -> Result<Option<T>> {
        self.take(name)
            .map(|v| {
                v.parse()
                    .map_err(|_| self.bad_value(name, &v, &format!("expected {expected}")))
            })
            .transpose()
    }

    /// Takes option `name` out as one of `choices` (compared without case).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the option and the choices if its value
    /// is none of them.
    pub fn take_choice<T: Copy>(&mut self, name: &str, choices: &[(&str, T)]) -> Result<Option<T>> {
        self.take(name)
            .map(|v| {
                choices
                    .iter()
                    .find(|(c, _)| c.eq_ignore_ascii_case(&v))
                    .map(|(_, t)| *t)
                    .ok_or_else(|| {
                        let names: Vec<&str> = choices.iter().map(|(c, _)| *c).collect();
                        self.bad_value(name, &v, &format!("expected {}", names.join(" or ")))
                    })
            })
            .transpose()
    }

    /// Takes the options the SQL backends share: `mode=` (one of `modes`,
    /// the first being the default), `ttl=` (a duration) and `pool=` (a
    /// positive number, `pool` if absent). Returns the mode, the TTL and the
    /// pool size.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the option whose value is wrong.
    ///
    /// # Examples
    ///
    /// ```
    /// use fencelock_core::backend::BackendUrl;
    ///
    /// let mut u = BackendUrl::parse("postgres", "postgres://h/db?mode=advisory&pool=2", &["postgres"])?;
    /// let (mode, ttl, pool) = u.take_sql_options(&[("lease", 0), ("advisory", 1)], 8)?;
    /// assert_eq!((mode, ttl, pool), (1, None, 2));
    /// assert!(u.take_sql_options(&[("lease", 0)], 8).is_ok()); // taken: defaults now
    /// # Ok::<(), fencelock_core::Error>(())
    /// ```
    pub fn take_sql_options<M: Copy>(
        &mut self,
        modes: &[(&str, M)],
        pool: u32,
    ) -> Result<(M, Option<Duration>, u32)> {
        let default = modes
            .first()
            .map(|(_, m)| *m)
            .ok_or_else(|| Error::config(format!("{}: no modes to choose from", self.backend)))?;
        let mode = self.take_choice("mode", modes)?.unwrap_or(default);
        let ttl = self.take_duration("ttl")?;
        let pool = self
            .take_parsed::<std::num::NonZeroU32>("pool", "a positive number")?
            .map_or(pool, std::num::NonZeroU32::get);
        Ok((mode, ttl, pool))
    }

    /// The error of option `name` whose value `value` is wrong: `why`.
    pub fn bad_value(&self, name: &str, value: &str, why: &str) -> Error {
        Error::config(format!("{} option {name}={value:?}: {why}", self.backend))
    }

    /// The options not taken, as written in the URL (`name=value`), for a
    /// client library that has options of its own.
    pub fn rest(&self) -> Vec<&str> {
        self.options.iter().map(|o| o.raw.as_str()).collect()
    }

    /// The option names asked for so far, in order: the options the backend
    /// knows (its docs' table is checked against them).
    pub fn asked(&self) -> &[String] {
        &self.asked
    }

    /// `base` with the options not taken appended as its query (for a
    /// client library's URL).
    pub fn with_rest(&self, base: &str) -> String {
        let rest = self.rest();
        if rest.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", rest.join("&"))
        }
    }

    /// Checks that every option was taken.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the first option left and the ones the
    /// backend asked for.
    pub fn finish(&self) -> Result<()> {
        match self.options.first() {
            None => Ok(()),
            Some(o) => Err(Error::config(format!(
                "unknown {} option {:?}; known: {}",
                self.backend,
                o.name,
                self.asked.join(", ")
            ))),
        }
    }
}

/// Decodes `%XX` escapes; `None` for a bad escape or bytes that are not UTF-8.
fn percent_decode(text: &str) -> Option<String> {
    if !text.contains('%') {
        return Some(text.to_string());
    }
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = text.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(url: &str) -> Result<BackendUrl> {
        BackendUrl::parse("test", url, &["test", "tests"])
    }

    #[test]
    fn takes_apart_login_hosts_path_and_options() {
        let mut u = parse("TEST://app:p%40ss%3Aw@h1:1,h2/db/x?a=1&b=%2Fx&flag&a=2").unwrap();
        assert_eq!(u.scheme(), "test");
        assert_eq!(u.user(), Some("app"));
        assert_eq!(u.password(), Some("p@ss:w"));
        assert_eq!(u.hosts().collect::<Vec<_>>(), ["h1:1", "h2"]);
        assert_eq!(u.path(), "/db/x");
        assert_eq!(u.base(), "TEST://app:p%40ss%3Aw@h1:1,h2/db/x");
        assert_eq!(u.rest(), ["a=1", "b=%2Fx", "flag", "a=2"]);
        assert_eq!(u.with_rest("x://h"), "x://h?a=1&b=%2Fx&flag&a=2");
        assert_eq!(u.take("a").as_deref(), Some("2"), "the last value wins");
        assert_eq!(u.take("b").as_deref(), Some("/x"));
        assert_eq!(u.take("flag").as_deref(), Some(""));
        assert_eq!(u.take("a"), None);
        u.finish().unwrap();
        assert_eq!(u.asked(), ["a", "b", "flag"]);
        let bare = parse("test:///var/lib/x.db").unwrap();
        assert_eq!(bare.hosts().count(), 0);
        assert_eq!(bare.path(), "/var/lib/x.db");
        assert_eq!(parse("test://u@h").unwrap().password(), None);
    }

    #[test]
    fn bad_values_and_unknown_options_are_named() {
        let mut u = parse("test://h?ttl=soon&pool=x&mode=rows&colour=red").unwrap();
        let e = u.take_duration("ttl").unwrap_err().to_string();
        assert!(
            e.contains("test option ttl=\"soon\"") && e.contains("ttl=5s"),
            "{e}"
        );
        let e = u
            .take_parsed::<u32>("pool", "a number")
            .unwrap_err()
            .to_string();
        assert!(e.contains("pool=\"x\": expected a number"), "{e}");
        let e = u
            .take_choice("mode", &[("lease", 1), ("advisory", 2)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("expected lease or advisory"), "{e}");
        let e = u.finish().unwrap_err().to_string();
        assert!(
            e.contains("unknown test option \"colour\"; known: ttl, pool, mode"),
            "{e}"
        );
        let mut ok = parse("test://h?mode=ADVISORY").unwrap();
        assert_eq!(
            ok.take_choice("mode", &[("lease", 1), ("advisory", 2)])
                .unwrap(),
            Some(2)
        );
    }

    #[test]
    fn other_schemes_and_bad_escapes_are_refused_without_the_password() {
        let e = parse("redis://u:secret@h").unwrap_err().to_string();
        assert!(
            e.contains("not a URL of the test backend; write test:// or tests://")
                && !e.contains("secret"),
            "{e}"
        );
        let e = parse("test://u:s%zzret@h").unwrap_err().to_string();
        assert!(
            e.contains("bad escape in the password") && !e.contains("s%zz"),
            "{e}"
        );
        assert!(parse("test://h?prefix=%ff").is_err(), "not UTF-8");
        assert!(parse("test://h?prefix=%4").is_err(), "a short escape");
    }
}
